"""The measurement behind docs/results/planner.md's "Lookup's chains priced per category" section: runs
`python -m eval ...` (a hybrid export, `tree.size=auto`) in this process with a second hybrid beside the default one,
planned on the same cost curve, that is never told the prompts' categories (lookup's chains priced on the run's rates
and the prompt's own, as before `380fbcf`). Both decode every prompt, interleaved, so before and after share the
machine's state; per prompt it writes each one's seconds, rounds, new tokens, prediction and whether it matched plain
greedy, and `--table` prints per category tau, speedup and the prediction's error of both.

    python -m scripts.bench.hybrid_category OUT.json <python -m eval overrides...>
    python -m scripts.bench.hybrid_category --table OUT.json
"""

from __future__ import annotations

import collections
import json
import runpy
import sys
from pathlib import Path
from typing import Any

import eval.planning as planning
import eval.runner as runner_module
from eval.drafters.hybrid import HybridDrafter

AFTER, BEFORE = "speculative", "no_category"


class NoCategory(HybridDrafter):
    """The hybrid as it was before `380fbcf`: told no category, so every prompt starts from the run's rates."""

    def prompt_category(self, category: str) -> None:
        pass


def record(out: str) -> None:
    if Path(out).exists():
        raise SystemExit(f"{out} exists; this tool writes a new file and does not overwrite one: name another.")
    rows: list[dict[str, Any]] = []
    twin: list[Any] = []
    runner_class, plan_and_build = runner_module.Runner, planning.plan_and_build

    def build_twice(run: Any, family: str, *args: Any, **kwargs: Any) -> Any:
        built = plan_and_build(run, family, *args, **kwargs)
        if family == "hybrid" and not twin:
            twin.append(plan_and_build(run, family, *args, **{**kwargs, "curve": built.curve}).drafter)
            twin[0].__class__ = NoCategory
        return built

    def runner(verifier: Any, drafters: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if not twin:
            raise SystemExit("No hybrid was built: give a hybrid export under tree.size=auto (the defaults).")
        r = runner_class(verifier, {**drafters, BEFORE: twin[0]}, *args, **kwargs)
        decode = r.decode

        def recorded(ids: list[int], prompt_id: str = "", category: str = "", turn: int = 0) -> Any:
            s = decode(ids, prompt_id, category, turn)
            rows.append({"id": s.id, "category": s.category, "seconds": s.seconds, "predicted": s.predicted,
                         "rounds": {m: len(v) for m, v in s.lengths.items()},
                         "new_tokens": {m: len(o) for m, o in s.outputs.items()},
                         "match": {m: s.outputs[m] == s.outputs["baseline"] for m in (AFTER, BEFORE)}})
            return s

        r.decode = recorded  # type: ignore[method-assign]
        return r

    runner_module.Runner, planning.plan_and_build = runner, build_twice  # type: ignore[assignment,misc]
    try:
        runpy.run_module("eval", run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    finally:
        Path(out).write_text(json.dumps(rows))


def table(path: str) -> None:
    rows = [r for r in json.loads(Path(path).read_text()) if r["id"]]  # the warm-up prompt has no id
    cells: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        for key in (r["category"], "overall"):
            c = cells[key]
            c["prompts"] += 1
            c["baseline"] += r["seconds"]["baseline"]
            for m in (AFTER, BEFORE):
                p = r["predicted"][m]
                c[m + " rounds"] += r["rounds"][m]
                c[m + " tokens"] += r["new_tokens"][m]
                c[m + " s"] += r["seconds"][m]
                c[m + " predicted plain"] += p["tokens"] * p["step_ms"] + p["prefill_ms"]  # as eval/report.py
                c[m + " predicted ms"] += p["ms"] + p["prefill_ms"]
                c[m + " mismatches"] += not r["match"][m]
    print("| category | prompts | tau after / before | speedup after / before | after / before | "
          "prediction's error after / before | greedy mismatches |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted(cells, key=lambda k: (k == "overall", k)):
        c = cells[key]
        tau = {m: c[m + " tokens"] / c[m + " rounds"] for m in (AFTER, BEFORE)}
        speedup = {m: c["baseline"] / c[m + " s"] for m in (AFTER, BEFORE)}
        error = {m: c[m + " predicted plain"] / c[m + " predicted ms"] / speedup[m] - 1 for m in (AFTER, BEFORE)}
        print(f"| {key} | {c['prompts']} | {tau[AFTER]:.2f} / {tau[BEFORE]:.2f} | {speedup[AFTER]:.2f}x / "
              f"{speedup[BEFORE]:.2f}x | {speedup[AFTER] / speedup[BEFORE]:.3f} | {error[AFTER]:+.0%} / "
              f"{error[BEFORE]:+.0%} | {c[AFTER + ' mismatches'] + c[BEFORE + ' mismatches']} |")


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--table":
        table(sys.argv[2])
        return
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    out = sys.argv[1]
    sys.argv = ["eval", *sys.argv[2:]]
    record(out)


if __name__ == "__main__":
    main()

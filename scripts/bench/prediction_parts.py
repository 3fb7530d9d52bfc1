"""The measurement behind docs/results/planner.md's "The prediction made of what a round costs" section: runs
`python -m eval ...` in this process and writes, per prompt and planned method, the prediction as the code makes it
and, on the same rounds, as the code before `cbe06ce` made it (no prefill, no round overhead, a dynamic drafter's round
priced on the table's best tree), so before and after share every measured second; and the time of the engine's
one-time probe of each prompt's length (`eval.engine.session.prepare`, untimed since `c241ba0`), which plain decoding
paid inside its clock before.

    python -m scripts.bench.prediction_parts OUT.json <python -m eval overrides...>
    python -m scripts.bench.prediction_parts --table OUT.json
"""

from __future__ import annotations

import collections
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import eval.runner as runner
from eval.engine.timing import RoundOverhead
from eval.planner.adaptive import PlannedDrafter


def record(out: str) -> None:
    if Path(out).exists():
        raise SystemExit(f"{out} exists; this tool writes a new file and does not overwrite one: name another.")
    rows: list[dict[str, Any]] = []
    per_round, propose, decode = RoundOverhead.per_round, PlannedDrafter.propose, runner.Runner.decode
    prepare, probe_s = runner.prepare, [0.0]

    def timed_prepare(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        prepare(*args, **kwargs)
        probe_s[0] = time.perf_counter() - start

    def counted_per_round(self: RoundOverhead) -> float:
        v = per_round(self)
        self.probe_sum = getattr(self, "probe_sum", 0.0) + v  # type: ignore[attr-defined]
        return v

    def counted_propose(self: PlannedDrafter, input_ids: Any, hidden: Any) -> Any:
        draft = propose(self, input_ids, hidden)
        self.probe_old = getattr(self, "probe_old", 0.0) + 1.0 + sum(self._values())  # type: ignore[attr-defined]
        return draft

    def counted_decode(self: runner.Runner, ids: list[int], prompt_id: str = "", category: str = "",
                       turn: int = 0) -> Any:
        planned = {m: d for m, d in self.drafters.items() if hasattr(d, "overhead")}
        for d in planned.values():
            d.overhead.probe_sum = 0.0
            getattr(d, "primary", d).probe_old = 0.0
        s = decode(self, ids, prompt_id, category, turn)
        rows.append({"id": s.id, "category": s.category, "seconds": s.seconds, "probe_s": probe_s[0],
                     "new_tokens": {m: len(o) for m, o in s.outputs.items()},
                     "rounds": {m: len(v) for m, v in s.lengths.items()}, "predicted": s.predicted,
                     "before": {m: {"overhead_ms": d.overhead.probe_sum,
                                    "tokens": None if hasattr(d, "primary") else d.probe_old}
                                for m, d in planned.items()}})
        with open(out, "w") as f:
            json.dump(rows, f)
        return s

    RoundOverhead.per_round = counted_per_round  # type: ignore[method-assign]
    PlannedDrafter.propose = counted_propose  # type: ignore[method-assign]
    runner.Runner.decode = counted_decode  # type: ignore[method-assign]
    runner.prepare = timed_prepare  # type: ignore[assignment]
    runpy.run_module("eval", run_name="__main__")


def table(path: str) -> None:
    rows = [r for r in json.load(open(path)) if r["category"]]  # the warm-up prompt has no category
    for m in rows[0]["predicted"]:
        agg: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        for r in rows:
            p, b = r["predicted"][m], r["before"][m]
            old = b["tokens"] if b["tokens"] is not None else p["tokens"]
            for c in (r["category"], "overall"):
                a = agg[c]
                a["step"] += p["tokens"] * p["step_ms"]
                a["old_step"] += old * p["step_ms"]
                a["ms"] += p["ms"]
                a["prefill"] += p["prefill_ms"]
                a["overhead"] += b["overhead_ms"]
                a["tokens"] += p["tokens"]
                a["old_tokens"] += old
                a["rounds"] += r["rounds"][m]
                a["came"] += r["new_tokens"][m]
                a["s"] += r["seconds"][m]
                a["plain_s"] += r["seconds"]["baseline"]
                a["probe_s"] += r.get("probe_s", 0.0)
                a["plain_tokens"] += r["new_tokens"]["baseline"]
        print(f"\n{m}\n| category | measured (plain paying the engine's probe, as before) | predicted before -> "
              "after (error) | tau predicted before -> after / came |")
        print("|---|---|---|---|")
        within = [0, 0]
        for c in sorted(agg, key=lambda c: (c == "overall", c)):
            a = agg[c]
            measured = a["plain_s"] / a["s"] * a["came"] / a["plain_tokens"]
            paid = (a["plain_s"] + a["probe_s"]) / a["s"] * a["came"] / a["plain_tokens"]
            before = a["old_step"] / (a["ms"] - a["overhead"])
            after = (a["step"] + a["prefill"]) / (a["ms"] + a["prefill"])
            eb, ea = before / measured - 1, after / measured - 1
            if c != "overall":
                within[0] += abs(eb) <= 0.1
                within[1] += abs(ea) <= 0.1
            per_round = [a[k] / a["rounds"] for k in ("old_tokens", "tokens", "came")]
            tau = "{:.2f} -> {:.2f} / {:.2f}".format(*per_round)
            predicted = f"{before:.2f}x ({eb:+.0%}) -> {after:.2f}x ({ea:+.0%})"
            print(f"| {c} | {measured:.2f}x ({paid:.2f}x) | {predicted} | {tau} |")
        print(f"categories predicted within 10%: {within[0]} before, {within[1]} after")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2])
    else:
        target = sys.argv[1]
        sys.argv = ["eval", *sys.argv[2:]]
        record(target)

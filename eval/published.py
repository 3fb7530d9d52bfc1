"""What a run leaves (`write(run, samples, peers)`): report.json, profile.json, outputs.jsonl, the plots and the W&B
run, through the one report writer (eval.report.write_outputs) over one per-method table (eval.report.method_row): a
single-export run's methods are `speculative`, `drafter_alone` and `grafted_alone`, method=all's one per family. The
run says what it held: the verifier path it decided, the plans, the cost curves.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from data.prompts import prompt_set_label
from eval.drafters.build import ran_dtype
from eval.engine.session import engine_of
from eval.planner import cost
from eval.planning import plan_of
from eval.report import Sample, write_outputs
from eval.runner import sampling_record
from eval.setup import Run

COST_NOTE = ("verify time from the cost curve plus the drafter's measured draft time (draft_curve_ms, at the "
             "curve's sizes); acceptance, commit and Python overhead excluded")


def write(run: Run, samples: list[Sample], peers: dict[str, Any] | None) -> dict[str, Any]:
    """Write the run's report and return report.json's content."""
    s = run.settings
    record = sampling_record(s.sampling, s.sampled_drafts)
    depths = {m: d.max_depth for m, d in run.drafters.items()}
    if run.method == "all":
        meta = {"method": "all", "verifier": run.verifier.name, "checkpoint": [str(e.path) for e in run.exports],
                "max_new_tokens": s.max_new_tokens, "threads": s.threads, "dtype": s.dtype,
                "drafter_dtype": s.drafter_dtype, "engine": run.engine,
                "sampling": record | ({"left_out_as_trees": run.left_out} if run.left_out else {}),
                "trees": {m: d.describe() for m, d in run.drafters.items()},
                "plans": {m: asdict(p) for m, p in run.plans.items()},
                "prompt_sets": not isinstance(s.prompts, str)}
        return write_outputs(samples, meta, {}, depths, s.output_dir)
    # the dtype the drafter's weights ran in, read from the drafter (the setting where it has no weights of its own)
    ran = ran_dtype(run.drafter.describe()) or s.drafter_dtype
    meta = {"method": run.method, "tree": run.drafter.describe(), "verifier": run.verifier.name,
            "drafter_dtype": ran, "checkpoint": s.checkpoint_label, "sampling": record,
            "prompt_sets": None if isinstance(s.prompts, str) else [prompt_set_label(p) for p in s.prompts]}
    setting = {"threads": s.threads, "dtype": s.dtype, "drafter_dtype": ran, "device": str(run.verifier.device),
               "dtype_reason": s.dtype_reason, "engine": run.engine, "max_new_tokens": s.max_new_tokens,
               "prompt_source": prompt_source(s.prompts), "multi_turn": s.multi_turn,
               "tree": run.drafter.describe()}
    if run.engine == "engine":  # rows each weight's kernel is padded to, to stay batch-invariant here
        setting["engine_weight_rows"] = engine_of(run.verifier.model).weight_rows
    if run.predicted is not None:
        setting["cost_model"] = {**asdict(run.predicted), "tree_size_auto": run.auto_size, "plan": plan_of(run.drafter),
                                 "draft_curve_ms": run.draft_curve, "note": COST_NOTE}
    if run.curves:
        cost.write(run.curves, s.output_dir, f"{run.verifier.name}: verifier forward cost")
    report = write_outputs(samples, meta, setting, depths, s.output_dir, asdict(s.wandb), peers=peers)
    if run.predicted is not None:
        p = run.predicted
        rounds = report["predicted_speedup"]
        print(f"speedup: predicted {p.predicted_speedup:.2f}x from the cost curve ({p.size} drafts, E[tokens/round] "
              f"{p.expected_tokens:.2f}, verify {p.verify_ms:.1f} ms + draft {p.draft_ms:.1f} ms vs step "
              f"{p.step_ms:.1f} ms){' [tree.size=auto]' if run.auto_size else ''}"
              f"{'' if rounds is None else f', {rounds:.2f}x round by round (plan={plan_of(run.drafter)})'}; "
              f"measured {report['speedup']:.2f}x")
    return report


def prompt_source(prompts: str | tuple[str, ...]) -> str:
    """report.json's `prompt_source`: the set, or the sets as the command line lists them."""
    return prompts if isinstance(prompts, str) else str(list(prompts))

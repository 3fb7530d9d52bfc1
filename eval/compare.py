"""`python -m eval method=all`: every drafter family available on the same prompts, decoded through the same path
as a single-family run (eval.runner.Runner, interleaved per prompt so they share the machine's state; eval.harness
builds the drafters). This module reports them: one table (tau, tokens/s, speedup over our plain decoding and the
speedup the planner predicted, exactness) overall and per category, report.json with those rows, and a bar chart
(families.png).

Outside references: Hugging Face `generate`, its prompt lookup, and its assisted generation with the draft model as
`assistant_model` (a constant `num_assistant_tokens` = the draft model's depth), greedy or sampled like ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from eval.engine.protocol import Drafter
from eval.report import (
    LENGTH_EDGES,
    Sample,
    accept_by_window,
    length_group,
    method_row,
    num_or_dash,
    per_prompt,
    prompt_set_of,
    save_figure,
    write_json,
    write_report_files,
    write_samples,
)
from eval.settings import EvalSettings
from models.formats.export import ExportInfo
from models.verifiers.core import Verifier

REFERENCES = ("hf_generate", "hf_prompt_lookup", "hf_assisted")


def rows(samples: Sequence[Sample], methods: Sequence[str],
         depths: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Per method: its row of the per-method table (eval.report.method_row: tau and per-position acceptance, families
    only, `depths` each drafter's deepest draft so positions never accepted show as 0; tokens/s, speedup over our plain
    decoding, the planner's prediction, exactness), with drafter and verifier milliseconds per speculative round, and
    for our own loops the prefill apart: its seconds and the tokens/s of the decoding after it."""
    depths = depths or {}
    out = {}
    for m in ("baseline", *methods):
        draft_ms = verify_ms = None
        drawn = [s.lengths[m] for s in samples if m in s.lengths] if samples and m in samples[0].lengths else []
        rounds = sum(int(x.numel()) for x in drawn)
        longest = max((int(x.max()) for x in drawn if x.numel()), default=0)
        row = method_row(samples, m, max(longest, int(depths.get(m, 0))))
        if drawn and rounds and m in samples[0].times:  # one verify and one draft per round
            draft_ms = round(1000 * sum(s.times[m].get("draft_s", 0.0) for s in samples) / rounds, 3)
            verify_ms = round(1000 * sum(s.times[m].get("verify_s", 0.0) for s in samples) / rounds, 3)
        out[m] = {"tau": row["tau"], "tokens_per_s": row["tokens_per_s"], "speedup": row["speedup"],
                  "predicted_speedup": row["predicted_speedup"], "greedy_match": row["greedy_match"],
                  "accept_rate_per_position": row["accept_rate_per_position"], "draft_ms_per_round": draft_ms,
                  "verify_ms_per_round": verify_ms, "prefill_s": None, "decode_tokens_per_s": None}
        if samples and m in samples[0].times:  # ours: the prefill is timed apart
            pre = sum(s.times[m].get("prefill_s", 0.0) for s in samples)
            rest = sum(s.seconds[m] for s in samples) - pre
            out[m]["prefill_s"] = round(pre, 4)
            out[m]["decode_tokens_per_s"] = (round(sum(len(s.outputs[m]) for s in samples) / rest, 2)
                                             if rest > 0 else None)
    return out


def _table(title: str, by_method: dict[str, dict[str, Any]], exact: str) -> Table:
    """One row per method: tau, per-position acceptance, drafter and verify ms per round, tokens/s, speedup, match."""
    table = Table(title=title)
    for col in ("method", "tau", "alpha_1..4", "draft ms/round", "verify ms/round", "tokens/s", "speedup",
                "predicted", exact):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m, r in by_method.items():
        table.add_row(m, "-" if r["tau"] is None else f"{r['tau']:.2f}",
                      " ".join(f"{a:.2f}" for a in (r["accept_rate_per_position"] or [])[:4]) or "-",
                      num_or_dash(r["draft_ms_per_round"]), num_or_dash(r["verify_ms_per_round"]),
                      f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x",
                      "-" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}x",
                      f"{r['greedy_match']:.0%}")
    return table


def save_chart(table: dict[str, dict[str, Any]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(names)), 3.8))
    colors = ["tab:blue" if n == "baseline" else "tab:gray" if n in REFERENCES else "tab:green" for n in names]
    bars = ax.bar(names, [table[n]["speedup"] for n in names], color=colors)
    for bar, n in zip(bars, names):
        tau = table[n]["tau"]
        label = f"tau {tau:.2f}" if tau is not None else ""
        if table[n]["greedy_match"] < 1:
            label += f"\nmatch {table[n]['greedy_match']:.0%}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set(ylabel="speedup over plain greedy (tokens/s ratio)", title=title)
    ax.tick_params(axis="x", labelsize=6, rotation=30)
    save_figure(fig, path)
    return path


def report(s: EvalSettings, verifier: Verifier, drafters: dict[str, Drafter], exports: list[ExportInfo],
           samples: Sequence[Sample], sampling: dict[str, Any], engine: str,
           plans: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write report.json, outputs.jsonl and families.png for method=all, print the table; returns the report.
    `plans`: what tree.size=auto planned for each family it planned (its budget and predicted speedup)."""
    methods = [*drafters, *(r for r in REFERENCES if samples and r in samples[0].outputs)]
    categories = sorted({s.category for s in samples})
    depths = {m: d.max_depth for m, d in drafters.items()}
    groups = [g for g in map(length_group, (0, *LENGTH_EDGES)) if any(length_group(s.prompt_tokens) == g
                                                                      for s in samples)]
    report = {
        "method": "all", "verifier": verifier.name, "checkpoint": [str(e.path) for e in exports],
        "num_prompts": len(samples), "max_new_tokens": s.max_new_tokens, "threads": s.threads,
        "dtype": s.dtype, "drafter_dtype": s.drafter_dtype, "engine": engine,
        "sampling": sampling,
        "trees": {m: d.describe() for m, d in drafters.items()}, "plans": plans or {},
        "methods": rows(samples, methods, depths),
        "accept_by_window": {m: accept_by_window(samples, m) for m in drafters},
        "per_prompt": per_prompt(samples),
        "by_category": {c: rows([s for s in samples if s.category == c], methods, depths) for c in categories},
        "by_prompt_length": {g: rows([s for s in samples if length_group(s.prompt_tokens) == g], methods, depths)
                             for g in groups},
    }
    if not isinstance(s.prompts, str):  # prompts=[set, ...]: categories are "<set>/<category>"
        sets = list(dict.fromkeys(prompt_set_of(s.category) for s in samples))
        report["by_prompt_set"] = {p: rows([s for s in samples if prompt_set_of(s.category) == p], methods, depths)
                                   for p in sets}
    out_dir = s.output_dir
    write_report_files(out_dir, [
        ("report.json", lambda: write_json(out_dir / "report.json", report)),
        ("outputs.jsonl", lambda: write_samples(samples, out_dir)),
        ("families.png", lambda: save_chart(report["methods"], f"{verifier.name}, {len(samples)} prompts",
                                            out_dir / "families.png"))])
    console = Console()
    exact = "exact" if sampling["rule"] == "greedy" else "= plain"
    console.print(_table(f"every family on {len(samples)} prompts ({verifier.name}, {sampling['rule']})",
                         report["methods"], exact))
    for p, by_method in report.get("by_prompt_set", {}).items():
        n = sum(1 for s in samples if prompt_set_of(s.category) == p)
        console.print(_table(f"prompt set {p}: {n} prompts", by_method, exact))
    for title, by in (("tokens/s per category", report["by_category"]),
                      ("tokens/s per prompt length", report["by_prompt_length"])):
        grid = Table(title=f"{title} (prompts, then each method; our plain decoding's prefill apart)")
        for col in ("group", "n", *report["methods"], "plain prefill s"):
            head = col.split("/")[0] + col[col.find("@"):] * ("@" in col) if "/" in col else col  # family[@run]
            grid.add_column(head, justify="left" if col == "group" else "right")
        for g, r in by.items():
            n = sum(1 for s in samples
                    if (s.category if by is report["by_category"] else length_group(s.prompt_tokens)) == g)
            grid.add_row(g, str(n), *[f"{r[m]['tokens_per_s']:.1f}" for m in report["methods"]],
                         f"{r['baseline']['prefill_s']:.2f}")
        console.print(grid)
    console.print(f"report: {out_dir / 'report.json'}, chart: {out_dir / 'families.png'}")
    return report

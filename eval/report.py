"""From measured samples to what a user reads, through one writer (`write_outputs`) over one per-method table
(`method_row`): for a single-family run report.json (exactly the keys of REPORT_KEYS), profile.json (where the time
goes, per-prompt rows), a terminal table, PNG plots and a W&B run (offline unless an account is set up); for
method=all one row per family (`rows`), its tables and families.png.

Rates are ratios of sums (all tokens over all seconds), not means of per-prompt rates, so long answers weigh as much
as they cost. tau and alpha_k pool every speculative round of every prompt (see eval.engine.acceptance).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

from eval.engine.acceptance.protocol import mean_accept_length, per_position_acceptance
from runtime.errors import disk_full, disk_full_error
from runtime.wandb_mode import wandb_mode

SPECULATIVE = "speculative"  # the method label of a single-family run's drafter
METHODS = ("baseline", SPECULATIVE, "hf_generate", "hf_prompt_lookup")
ASSISTED = "hf_assisted"  # HF assisted generation with the run's draft model: drafter=draft_model runs only
# The export's drafter alone, measured beside a combination of it (drafter=hybrid, the default with an export:
# conf/eval.yaml `alone`), so the report gives what the drafter adds by itself and what the combination adds.
ALONE = "drafter_alone"
# ... and the drafter grafted into it (the hybrid's prompt lookup) alone, so the combination is shown beside both parts.
GRAFTED = "grafted_alone"
REPORT_KEYS = (
    "method", "tree", "verifier", "checkpoint", "drafter_dtype", "num_prompts", "new_tokens", "tau",
    "accept_rate_per_position",
    "tokens_per_s", "baseline_tokens_per_s", "hf_generate_tokens_per_s", "hf_prompt_lookup_tokens_per_s",
    "speedup", "predicted_speedup", "speedup_vs_hf_generate", "greedy_match",
    "draft_ms_per_round", "verify_ms_per_round", "plain_step_ms",
    "hf_assisted_tokens_per_s", "hf_assisted_speedup", "hf_assisted_greedy_match", "drafter_alone", "grafted_alone",
    "prompt_tokens",
    "prefill",
    "sampling", "by_category", "by_prompt_length", "by_prompt_set", "accept_by_window", "per_prompt",
)
RUN_KEYS = ("accept_by_window", "per_prompt")  # the whole run's only: not repeated per category or length
WINDOW = 64  # output tokens per window of accept_by_window
PARTS = ("prefill_s", "verify_s", "draft_s", "accept_s", "commit_s")  # DecodeResult.times; the rest of total_s: "other"
LENGTH_EDGES = (256, 512, 1024)  # prompt-length groups of the report: <256, 256-511, 512-1023, >=1024 tokens
OURS = ("baseline", SPECULATIVE)  # our loops: their prefill is timed apart
REFERENCES = ("hf_generate", "hf_prompt_lookup", "hf_assisted")  # method=all's outside references


@dataclass
class Sample:
    """One measured decode: a prompt (one turn of a conversation) through every method (METHODS, or with
    method=all one label per drafter in place of `speculative`).

    seconds / outputs: per method. lengths: per drafter, (R,) drafts accepted per speculative round, bonus excluded.
    forwards: verifier forwards of our loops; times: their DecodeResult.times (for the time breakdown).
    predicted: per planned drafter (tree.size=auto), what the planner predicted for this decode's rounds, each
        before it ran (eval.planner.adaptive.Prediction: rounds, E[tokens] and ms summed, the plain step's ms), and
        `prefill_ms`, the prompt's prefill as the decode timed it before its first round.
    """

    id: str
    category: str
    turn: int
    prompt_tokens: int
    seconds: dict[str, float]
    outputs: dict[str, list[int]]
    lengths: dict[str, Tensor]
    forwards: dict[str, int]
    times: dict[str, dict[str, float]] = field(default_factory=dict)
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def accept_lengths(self) -> Tensor:
        """The single-family run's drafter's accepted drafts per round (the first drafter's with method=all)."""
        return self.lengths.get(SPECULATIVE, next(iter(self.lengths.values())))

    @property
    def new_tokens(self) -> dict[str, int]:
        return {m: len(t) for m, t in self.outputs.items()}

    def matches(self, method: str) -> bool:
        """Does `method` emit exactly our plain greedy tokens?"""
        return self.outputs[method] == self.outputs["baseline"]


def methods_of(samples: Sequence[Sample]) -> tuple[str, ...]:
    """METHODS, and hf_assisted, drafter_alone and grafted_alone where the run measured them."""
    return METHODS + tuple(m for m in (ASSISTED, ALONE, GRAFTED) if samples and m in samples[0].outputs)


def _rate(samples: Sequence[Sample], method: str) -> float:
    seconds = sum(s.seconds[method] for s in samples)
    return sum(s.new_tokens[method] for s in samples) / seconds if seconds > 0 else 0.0


def length_group(tokens: int) -> str:
    """The prompt-length group of a prompt of `tokens` tokens (LENGTH_EDGES), e.g. `256-511`."""
    edges = (0, *LENGTH_EDGES)
    for lo, hi in zip(edges, edges[1:]):
        if tokens < hi:
            return f"{lo}-{hi - 1}"
    return f">={edges[-1]}"


def prefill(samples: Sequence[Sample]) -> dict[str, Any]:
    """Our loops' prefill apart from their decoding: seconds, prompt tokens/s, and new tokens/s after the prefill
    (a long prompt's prefill would otherwise hide in tokens/s)."""
    prompt = sum(s.prompt_tokens for s in samples)
    out: dict[str, Any] = {}
    for m in OURS:
        pre = sum(s.times.get(m, {}).get("prefill_s", 0.0) for s in samples)
        rest = sum(s.seconds[m] for s in samples) - pre
        out[m] = {"seconds": round(pre, 4), "prompt_tokens_per_s": round(prompt / pre, 2) if pre > 0 else None,
                  "decode_tokens_per_s": round(sum(s.new_tokens[m] for s in samples) / rest, 2) if rest > 0 else None}
    return out


def predicted_speedup(samples: Sequence[Sample], method: str = SPECULATIVE) -> float | None:
    """The speedup the planner predicted for `method` over `samples`, as the measured one is taken (all tokens over
    all time): its per-round predictions of E[tokens] and ms summed, against the plain step, each side with the
    prompts' prefill (`prefill_ms`, timed by the decode before its first round: the forward plain decoding runs too,
    which pulls a long prompt's speedup toward 1); None when the method was not planned (no tree.size=auto)."""
    rows = [s.predicted[method] for s in samples if method in s.predicted]
    prefill = sum(r.get("prefill_ms", 0.0) for r in rows)
    ms = sum(r["ms"] for r in rows) + prefill
    return round((sum(r["tokens"] * r["step_ms"] for r in rows) + prefill) / ms, 4) if rows and ms > 0 else None


def method_row(samples: Sequence[Sample], method: str, depth: int) -> dict[str, Any]:
    """One method's row of the per-method table, over `samples`: tau and per-position acceptance up to `depth` (None
    for a method that drafts nothing), tokens/s, speedup over our plain decoding, the planner's prediction, and how
    often it matched our plain decoding. The one computation of these figures: the single-family report (speculative,
    drafter_alone, grafted_alone) and method=all's table (`rows`) both take their rows from here."""
    rate, base = _rate(samples, method), _rate(samples, "baseline")
    tau = alpha = None
    if not samples or method in samples[0].lengths:
        lengths = torch.cat([s.lengths[method] for s in samples]) if samples else torch.zeros(0, dtype=torch.long)
        tau = round(mean_accept_length(lengths), 4)
        alpha = [round(a, 4) for a in per_position_acceptance(lengths, depth).tolist()]
    return {
        "tau": tau,
        "accept_rate_per_position": alpha,
        "tokens_per_s": round(rate, 2),
        "speedup": round(rate / base, 4) if base else 0.0,
        "predicted_speedup": predicted_speedup(samples, method),
        "greedy_match": round(sum(s.matches(method) for s in samples) / max(len(samples), 1), 4),
    }


def alone_metrics(samples: Sequence[Sample], rate: Mapping[str, float], depth: int, method: str = ALONE
                  ) -> dict[str, Any] | None:
    """`drafter_alone` (or `grafted_alone`, `method`) over `samples`: a part of the run's combination decoding by
    itself in the same run (None when the run measured no combination): its row of the per-method table."""
    return method_row(samples, method, depth) if method in rate else None


def round_ms(samples: Sequence[Sample], method: str) -> tuple[float | None, float | None]:
    """(drafting, verifying) milliseconds per speculative round of one of our loops over `samples`: their seconds
    over its rounds (one draft and one verify a round); None for a method without rounds or times (HF's)."""
    drawn = [s.lengths[method] for s in samples if method in s.lengths]
    rounds = sum(int(x.numel()) for x in drawn)
    if not rounds or not samples or method not in samples[0].times:
        return None, None
    draft, verify = (round(1000 * sum(s.times[method].get(part, 0.0) for s in samples) / rounds, 3)
                     for part in ("draft_s", "verify_s"))
    return draft, verify


def plain_step_ms(samples: Sequence[Sample]) -> float | None:
    """Milliseconds of one plain decoding step (our `baseline` loop's verifier forward after the prefill, one a
    prompt), what a speculative round's parts compare against."""
    if not samples or "baseline" not in samples[0].times:
        return None
    forwards = sum(s.forwards["baseline"] for s in samples) - len(samples)
    verify = sum(s.times["baseline"].get("verify_s", 0.0) for s in samples)
    return round(1000 * verify / forwards, 3) if forwards > 0 else None


def metrics(samples: Sequence[Sample], depth: int, alone_depths: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The report's metric keys over `samples` (all of them, or one category's): the `speculative` row of the
    per-method table under the report's names, and the references' rates; the hf_assisted ones are null when the run
    had no draft model, drafter_alone and grafted_alone (their drafters' deepest drafts: `alone_depths`) when it
    measured no combination."""
    depths = alone_depths or {}
    rate = {m: _rate(samples, m) for m in methods_of(samples)}
    assisted = ASSISTED in rate
    row = method_row(samples, SPECULATIVE, depth)
    return {
        "num_prompts": len(samples),
        "new_tokens": sum(s.new_tokens["speculative"] for s in samples),
        "tau": row["tau"],
        "accept_rate_per_position": row["accept_rate_per_position"],
        "tokens_per_s": row["tokens_per_s"],
        "baseline_tokens_per_s": round(rate["baseline"], 2),
        "hf_generate_tokens_per_s": round(rate["hf_generate"], 2),
        "hf_prompt_lookup_tokens_per_s": round(rate["hf_prompt_lookup"], 2),
        "speedup": row["speedup"],
        "predicted_speedup": row["predicted_speedup"],
        "speedup_vs_hf_generate": round(rate["speculative"] / rate["hf_generate"], 4) if rate["hf_generate"] else 0.0,
        "greedy_match": row["greedy_match"],
        **dict(zip(("draft_ms_per_round", "verify_ms_per_round"), round_ms(samples, SPECULATIVE))),
        "plain_step_ms": plain_step_ms(samples),
        "hf_assisted_tokens_per_s": round(rate[ASSISTED], 2) if assisted else None,
        "hf_assisted_speedup": round(rate[ASSISTED] / rate["baseline"], 4) if assisted and rate["baseline"] else None,
        "hf_assisted_greedy_match":
            round(sum(s.matches(ASSISTED) for s in samples) / max(len(samples), 1), 4) if assisted else None,
        "drafter_alone": alone_metrics(samples, rate, depths.get(ALONE, 0), ALONE),
        "grafted_alone": alone_metrics(samples, rate, depths.get(GRAFTED, 0), GRAFTED),
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
        "prefill": prefill(samples),
    }


def accept_by_window(samples: Sequence[Sample], method: str, window: int = WINDOW) -> list[dict[str, Any]]:
    """Acceptance against output position: the rounds of `method` that started in each `window`-token window of the
    output (the prefill emits token 0; round r starts at 1 + sum of the earlier rounds' accepted + 1), over every
    prompt, with their tau (1 + drafts accepted per round). Decay over long outputs shows as a falling tau."""
    rounds: dict[int, list[int]] = {}
    for sample in samples:
        position = 1
        for accepted in sample.lengths[method].tolist():
            rounds.setdefault(position // window, []).append(int(accepted))
            position += int(accepted) + 1
    return [{"window": [w * window, (w + 1) * window - 1], "rounds": len(a), "tau": round(1 + sum(a) / len(a), 4)}
            for w, a in sorted(rounds.items())]


def per_prompt(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Every prompt's figures per method, in the order decoded (a stream's halves can be compared): new tokens,
    rounds (verifier forwards for our plain loop; null for HF's), tau (null where no drafter ran) and tokens/s."""
    out = []
    for sample in samples:
        for method in sample.outputs:  # every method measured on it, in the order run
            drafts = sample.lengths.get(method)
            seconds = sample.seconds[method]
            out.append({"id": sample.id, "category": sample.category, "turn": sample.turn, "method": method,
                        "new_tokens": sample.new_tokens[method],
                        "rounds": len(drafts) if drafts is not None else sample.forwards.get(method),
                        "tau": round(mean_accept_length(drafts), 4) if drafts is not None and len(drafts) else None,
                        "tokens_per_s": round(sample.new_tokens[method] / seconds, 2) if seconds > 0 else 0.0})
    return out


def build_report(samples: Sequence[Sample], meta: Mapping[str, Any], depth: int,
                 alone_depths: Mapping[str, int] | None = None) -> dict[str, Any]:
    """report.json: `meta` (method, tree, verifier, checkpoint, sampling), the metrics overall, and the same per
    category, per prompt length and, when `meta["prompt_sets"]` names several sets (prompts=[builtin, humaneval,
    ...], categories "<set>/<category>"), per prompt set (else `by_prompt_set` is empty)."""
    categories = sorted({s.category for s in samples})
    by_category = {c: metrics([s for s in samples if s.category == c], depth, alone_depths) for c in categories}
    groups = [g for g in map(length_group, (0, *LENGTH_EDGES)) if any(length_group(s.prompt_tokens) == g
                                                                      for s in samples)]
    by_length = {g: metrics([s for s in samples if length_group(s.prompt_tokens) == g], depth, alone_depths)
                 for g in groups}
    by_set = {p: metrics([s for s in samples if prompt_set_of(s.category) == p], depth, alone_depths)
              for p in meta.get("prompt_sets") or []}
    drafting = [m for m in methods_of(samples) if samples and m in samples[0].lengths]
    report = {**meta, **metrics(samples, depth, alone_depths), "by_category": by_category,
              "by_prompt_length": by_length, "by_prompt_set": by_set,
              "accept_by_window": {m: accept_by_window(samples, m) for m in drafting},
              "per_prompt": per_prompt(samples)}
    report.setdefault("sampling", {"temperature": 0.0, "rule": "greedy", "exact": True, "lossy": False})
    report.setdefault("drafter_dtype", "float32")  # eval's default: the export's weights as saved
    if report["sampling"].get("rule", "greedy") != "greedy":
        # Sampled outputs equal the sampled baseline's only by chance: greedy_match is null, not a misleading 0.
        for m in [report, *by_category.values(), *by_length.values(), *by_set.values()]:
            m["greedy_match"] = m["hf_assisted_greedy_match"] = None
            for part in (ALONE, GRAFTED):
                if m[part] is not None:
                    m[part]["greedy_match"] = None
    return {k: report[k] for k in REPORT_KEYS}


# -- method=all: one row per family (the per-method table of every drafter and reference) ------------------------

def rows(samples: Sequence[Sample], methods: Sequence[str],
         depths: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Per method: its row of the per-method table (eval.report.method_row: tau and per-position acceptance, families
    only, `depths` each drafter's deepest draft so positions never accepted show as 0; tokens/s, speedup over our plain
    decoding, the planner's prediction, exactness), with drafter and verifier milliseconds per speculative round, and
    for our own loops the prefill apart: its seconds and the tokens/s of the decoding after it."""
    depths = depths or {}
    out = {}
    for m in ("baseline", *methods):
        drawn = [s.lengths[m] for s in samples if m in s.lengths] if samples and m in samples[0].lengths else []
        longest = max((int(x.max()) for x in drawn if x.numel()), default=0)
        row = method_row(samples, m, max(longest, int(depths.get(m, 0))))
        draft_ms, verify_ms = round_ms(samples, m)
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


def families_table(title: str, by_method: dict[str, dict[str, Any]], exact: str) -> Table:
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


def build_families(samples: Sequence[Sample], meta: Mapping[str, Any], depths: Mapping[str, int]) -> dict[str, Any]:
    """method=all's report.json: `meta` (verifier, exports, settings, each drafter's tree and plan), then the
    per-method table (`rows`: every drafter, in `depths`' order, and the references the run measured) overall, per
    category, per prompt length and, with several prompt sets, per set; acceptance by output window and per prompt."""
    drafters = list(depths)
    methods = [*drafters, *(r for r in REFERENCES if samples and r in samples[0].outputs)]
    categories = sorted({s.category for s in samples})
    groups = [g for g in map(length_group, (0, *LENGTH_EDGES)) if any(length_group(s.prompt_tokens) == g
                                                                      for s in samples)]
    report = {
        **{k: meta[k] for k in ("method", "verifier", "checkpoint")}, "num_prompts": len(samples),
        **{k: v for k, v in meta.items() if k not in ("method", "verifier", "checkpoint", "prompt_sets")},
        "methods": rows(samples, methods, dict(depths)),
        "accept_by_window": {m: accept_by_window(samples, m) for m in drafters},
        "per_prompt": per_prompt(samples),
        "by_category": {c: rows([s for s in samples if s.category == c], methods, dict(depths)) for c in categories},
        "by_prompt_length": {g: rows([s for s in samples if length_group(s.prompt_tokens) == g], methods,
                                     dict(depths)) for g in groups},
    }
    if meta.get("prompt_sets"):  # prompts=[set, ...]: categories are "<set>/<category>"
        sets = list(dict.fromkeys(prompt_set_of(s.category) for s in samples))
        report["by_prompt_set"] = {p: rows([s for s in samples if prompt_set_of(s.category) == p], methods,
                                           dict(depths)) for p in sets}
    return report


def print_families(report: Mapping[str, Any], samples: Sequence[Sample], console: Console) -> None:
    """method=all's terminal tables: every family overall and per prompt set, then tokens/s per category and per
    prompt length."""
    exact = "exact" if report["sampling"]["rule"] == "greedy" else "= plain"
    console.print(families_table(f"every family on {len(samples)} prompts ({report['verifier']}, "
                                 f"{report['sampling']['rule']})", report["methods"], exact))
    for p, by_method in report.get("by_prompt_set", {}).items():
        n = sum(1 for s in samples if prompt_set_of(s.category) == p)
        console.print(families_table(f"prompt set {p}: {n} prompts", by_method, exact))
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


def _breakdown(samples: Sequence[Sample], loop: str) -> dict[str, Any]:
    """Seconds per bucket of one of our loops, summed over prompts; `other_s` is the Python between buckets.
    ms_per_verifier_forward averages the forwards after the prefill (one a prompt, in `prefill_s`)."""
    parts = {p: sum(s.times[loop].get(p, 0.0) for s in samples) for p in PARTS}
    total = sum(s.times[loop]["total_s"] for s in samples)
    parts["other_s"] = max(total - sum(parts.values()), 0.0)
    forwards = sum(s.forwards[loop] for s in samples)
    return {
        **{k: round(v, 4) for k, v in parts.items()},
        "total_s": round(total, 4),
        "share": {k.removesuffix("_s"): round(v / total, 4) if total else 0.0 for k, v in parts.items()},
        "verifier_forwards": forwards,
        "ms_per_verifier_forward":
            round(1000 * parts["verify_s"] / (forwards - len(samples)), 3) if forwards > len(samples) else 0.0,
    }


def build_profile(samples: Sequence[Sample], setting: Mapping[str, Any]) -> dict[str, Any]:
    """profile.json: the run's settings, the time breakdown of our two loops, wall time per method, how often each
    method's output equals plain greedy, and one row per prompt."""
    return {
        **setting,
        "time_breakdown": {loop: _breakdown(samples, loop) for loop in ("speculative", "baseline")},
        "wall_s": {m: round(sum(s.seconds[m] for s in samples), 4) for m in methods_of(samples)},
        "match_plain_greedy": {m: round(sum(s.matches(m) for s in samples) / max(len(samples), 1), 4)
                               for m in methods_of(samples)},
        "per_prompt": [
            {"id": s.id, "category": s.category, "turn": s.turn, "prompt_tokens": s.prompt_tokens,
             "new_tokens": s.new_tokens, "seconds": {m: round(v, 4) for m, v in s.seconds.items()},
             "tau": round(mean_accept_length(s.accept_lengths), 4), "greedy_match": s.matches("speculative"),
             "predicted_speedup": predicted_speedup([s]),
             "speedup": round(s.seconds["baseline"] / s.seconds["speculative"] * s.new_tokens["speculative"]
                              / max(s.new_tokens["baseline"], 1), 4) if s.seconds.get("speculative") else None}
            for s in samples
        ],
    }


def _match(report: Mapping[str, Any]) -> str:
    """The headline's exactness: greedy match, or the sampling rule (LOSSY for typical acceptance)."""
    if report["greedy_match"] is not None:
        return f"greedy match {report['greedy_match']:.0%}"
    s = report["sampling"]
    return (f"sampled at temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']}: {s['rule']}"
            + (" -- LOSSY: output does not follow the verifier's distribution" if s.get("lossy") else ""))


def prompt_set_of(category: str) -> str:
    """The prompt set of a sample's category: with prompts=[set, ...] categories are "<set>/<category>"."""
    return category.split("/")[0]


def num_or_dash(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_summary(report: Mapping[str, Any], profile: Mapping[str, Any], console: Console | None = None) -> None:
    """The terminal view: methods side by side, per category, and where the speculative loop spends its time."""
    console = console or Console()
    alpha = ", ".join(f"{a:.2f}" for a in report["accept_rate_per_position"])
    console.print(f"[bold]{report['method']}[/] on {report['verifier']}: {report['num_prompts']} prompts, "
                  f"tau {report['tau']:.3f}, alpha_k [{alpha}], {_match(report)}")
    rates = {"speculative": report["tokens_per_s"], "baseline": report["baseline_tokens_per_s"],
             "hf_generate": report["hf_generate_tokens_per_s"],
             "hf_prompt_lookup": report["hf_prompt_lookup_tokens_per_s"]}
    if report["hf_assisted_tokens_per_s"] is not None:
        rates[ASSISTED] = report["hf_assisted_tokens_per_s"]
    for part in (ALONE, GRAFTED):
        if report[part] is not None:
            rates[part] = report[part]["tokens_per_s"]
    rates |= peer_rates(report)
    table = Table(title="tokens/s, measured side by side")
    for col in ("method", "tokens/s", "speculative speedup", "= plain greedy"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m, r in rates.items():
        match = profile["match_plain_greedy"].get(m)
        table.add_row(m, f"{r:.1f}", f"{rates['speculative'] / r:.2f}x" if r else "-",
                      "-" if match is None else f"{match:.0%}")
    console.print(table)
    for name, peer in (report.get("engine_peers") or {}).items():
        spec = peer.get("speculative")
        if spec:
            a = (f"alpha_k [{', '.join(f'{x:.2f}' for x in spec['accept_rate_per_position'])}]"
                 if spec["accept_rate_per_position"] else  # an engine that counts accepted tokens, not positions
                 f"{spec.get('accepted_per_round') or 0:.2f} accepted per round")
            console.print(f"{name} {peer['version']} with this drafter ({spec['speculative_tokens']} tokens): tau "
                          f"{spec['tau'] or 0:.3f}, {a}, speedup {spec['speedup'] or 0:.2f}x "
                          f"over {name} plain")
        else:
            console.print(f"{name} {peer['version']}: {peer.get('note', 'plain only')}")
    for title, groups in (("per prompt set", report.get("by_prompt_set") or {}),
                          ("per category", report["by_category"]),
                          ("per prompt length", report["by_prompt_length"])):
        if not groups:
            continue
        cats = Table(title=f"{title}; prefill apart: ours (plain) prompt tok/s, decode tok/s after it")
        # the combination's parts by themselves (its drafter, its grafted drafter): their tau and speedup
        parts = [(p, label) for p, label in ((ALONE, "alone"), (GRAFTED, "grafted")) if report[p] is not None]
        for col in ("group", "n", "prompt", "tau", "alpha_1", "tokens/s", "plain", "HF", "HF lookup", "speedup",
                    "predicted", *(f"{label} {x}" for _, label in parts for x in ("tau", "speedup")), "vs HF",
                    "prefill tok/s",
                    "decode tok/s", "greedy match"):
            cats.add_column(col, justify="left" if col == "group" else "right")
        for c, m in groups.items():
            a1 = m["accept_rate_per_position"][0] if m["accept_rate_per_position"] else 0.0
            pre = m["prefill"]
            cats.add_row(c, str(m["num_prompts"]), str(m["prompt_tokens"] // max(m["num_prompts"], 1)),
                         f"{m['tau']:.2f}", f"{a1:.2f}", f"{m['tokens_per_s']:.1f}",
                         f"{m['baseline_tokens_per_s']:.1f}",
                         f"{m['hf_generate_tokens_per_s']:.1f}", f"{m['hf_prompt_lookup_tokens_per_s']:.1f}",
                         f"{m['speedup']:.2f}x",
                         "-" if m["predicted_speedup"] is None else f"{m['predicted_speedup']:.2f}x",
                         *(cell for p, _ in parts for cell in (f"{m[p]['tau']:.2f}", f"{m[p]['speedup']:.2f}x")),
                         f"{m['speedup_vs_hf_generate']:.2f}x",
                         num_or_dash(pre["baseline"]["prompt_tokens_per_s"]),
                         num_or_dash(pre[SPECULATIVE]["decode_tokens_per_s"]),
                         "-" if m["greedy_match"] is None else f"{m['greedy_match']:.0%}")
        console.print(cats)
    times = Table(title="where the time goes: seconds (share)")
    for col in ("loop", "prefill", "verify", "draft", "accept", "commit", "other", "total", "ms/fwd"):
        times.add_column(col, justify="left" if col == "loop" else "right")
    for loop, b in profile["time_breakdown"].items():
        cells = [f"{b[p + '_s']:.2f} {b['share'][p]:.0%}"
                 for p in ("prefill", "verify", "draft", "accept", "commit", "other")]
        times.add_row(loop[:4], *cells, f"{b['total_s']:.2f}", f"{b['ms_per_verifier_forward']:.1f}")
    console.print(times)


def save_plots(samples: Sequence[Sample], report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """PNG plots in out_dir: accepted drafts per round, acceptance per draft position, tokens/s per method."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers, and no GUI backend to start
    import matplotlib.pyplot as plt

    depth = len(report["accept_rate_per_position"])
    lengths = torch.cat([s.accept_lengths for s in samples]) if samples else torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(lengths, minlength=depth + 1).float()
    paths = []

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(range(depth + 1), (counts / counts.sum().clamp(min=1)).tolist())
    ax.set(xlabel="draft tokens accepted in a round", ylabel="fraction of rounds",
           title=f"{report['method']}: tau = {report['tau']:.2f}")
    paths.append(save_figure(fig, out_dir / "accept_length_hist.png"))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    k = list(range(1, depth + 1))
    ax.bar(k, report["accept_rate_per_position"], color="lightgray", label="all")
    for cat, m in report["by_category"].items():
        ax.plot(k, m["accept_rate_per_position"], marker="o", label=cat)
    ax.set(xlabel="draft position k", ylabel="alpha_k (fraction of rounds)", ylim=(0, 1), xticks=k,
           title="acceptance per draft position")
    ax.legend(fontsize=6, ncol=2)
    paths.append(save_figure(fig, out_dir / "accept_per_position.png"))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["speculative", "baseline", "hf_generate", "hf_prompt_lookup"]
    values = [report["tokens_per_s"], report["baseline_tokens_per_s"], report["hf_generate_tokens_per_s"],
              report["hf_prompt_lookup_tokens_per_s"]]
    if report["hf_assisted_tokens_per_s"] is not None:
        names, values = names + [ASSISTED], values + [report["hf_assisted_tokens_per_s"]]
    for part in (ALONE, GRAFTED):
        if report[part] is not None:
            names, values = names + [part], values + [report[part]["tokens_per_s"]]
    for name, rate in peer_rates(report).items():
        names, values = names + [name], values + [rate]
    ax.bar(names, values, color=["tab:green", "tab:blue"] + ["tab:gray"] * (len(names) - 2))
    ax.set(ylabel="tokens/s", title=f"speedup {report['speedup']:.2f}x over plain greedy")
    ax.tick_params(axis="x", labelsize=7)
    paths.append(save_figure(fig, out_dir / "tokens_per_s.png"))
    return paths


def peer_rates(report: Mapping[str, Any]) -> dict[str, float]:
    """tokens/s of the serving engines measured beside us (`engine_peers`): `<engine>` plain, `<engine>_speculative`,
    and `<engine>_prompt_lookup` for an engine with its own (OpenVINO GenAI)."""
    rates = {}
    for name, peer in (report.get("engine_peers") or {}).items():
        rates[name] = peer["plain"]["tokens_per_s"]
        for part in ("speculative", "prompt_lookup"):
            if peer.get(part):
                rates[f"{name}_{part}"] = peer[part]["tokens_per_s"]
    return rates


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write and close a matplotlib figure as `path` (its suffix the format), whole or not at all."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        _replace(path, lambda tmp: fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".")))
    finally:
        plt.close(fig)
    return path


def _replace(path: Path, write: Any) -> None:
    """`write(tmp)` a scratch file beside `path`, then rename it over `path`: a full disk leaves the previous file
    whole (or none), never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_report_files(out_dir: Path, steps: Sequence[tuple[str, Callable[[], Any]]]) -> list[str]:
    """Run each (name, write) step into `out_dir`; returns the names written. Each file is written whole or not at all
    (a scratch file renamed over it), so a full disk ends in one message that says which are written and that the
    others keep their previous version."""
    written: list[str] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, write in steps:
            write()
            written.append(name)
    except Exception as e:
        if not disk_full(e):
            raise
        kept = f"Written whole: {', '.join(written)}; " if written else "Nothing of this run's report was written; "
        raise disk_full_error(out_dir, "writing the report", f"{kept}every file not written keeps its previous "
                                                             f"version, if any.") from e
    return written


def write_json(path: Path, content: Any) -> Path:
    """`content` as indented JSON in `path`, whole or not at all (a scratch file renamed over it)."""
    _write_text(path, json.dumps(content, indent=2))
    return path


def _write_text(path: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # a full disk may show only here (delayed allocation, network file systems)

    _replace(path, write)


def log_wandb(
    report: Mapping[str, Any], profile: Mapping[str, Any], plots: Sequence[Path], out_dir: Path,
    mode: str | None = None, project: str = "specdraft", name: str | None = None,
) -> str:
    """Log the report's figures, the per-category and per-prompt tables and the plots to a W&B run under
    `<out_dir>/wandb/`. Returns the mode used."""
    mode = wandb_mode(mode)
    if mode == "disabled":
        return mode
    import wandb

    settings = {k: v for k, v in profile.items() if k not in ("per_prompt", "time_breakdown")}
    run = wandb.init(dir=str(out_dir), mode=mode, project=project, name=name, job_type="eval",
                     config={**settings, "method": report["method"], "verifier": report["verifier"],
                             "checkpoint": report["checkpoint"]})
    try:
        _log_run(run, report, profile, plots)
    except Exception as e:
        if disk_full(e):  # the log files on the same disk fail too: not a traceback per log record
            logging.raiseExceptions = False
        with contextlib.suppress(Exception):  # (a full disk fails the finish too): the run is closed, not left open
            run.finish(exit_code=1)
        raise
    return mode


def _log_run(run: Any, report: Mapping[str, Any], profile: Mapping[str, Any], plots: Sequence[Path]) -> None:
    import wandb

    scalars = {f"eval/{k}": v for k, v in report.items() if isinstance(v, (int, float))}
    scalars |= {f"eval/alpha_{k}": a for k, a in enumerate(report["accept_rate_per_position"], 1)}
    for part in (ALONE, GRAFTED):
        scalars |= {f"eval/{part}_{k}": v for k, v in (report[part] or {}).items() if isinstance(v, (int, float))}
    for loop, b in profile["time_breakdown"].items():
        scalars |= {f"profile/{loop}/{k}": v for k, v in b.items() if isinstance(v, (int, float))}
    first = next(iter(report["by_category"].values()), {})
    cols = ["category", *[k for k, v in first.items() if not isinstance(v, (list, dict))]]
    by_cat = wandb.Table(columns=cols, data=[[c, *[m[k] for k in cols[1:]]] for c, m in report["by_category"].items()])
    methods = list(profile["wall_s"])
    rows = [[p["id"], p["category"], p["turn"], p["prompt_tokens"], p["new_tokens"]["speculative"], p["tau"],
             p["greedy_match"], *[p["seconds"][m] for m in methods]] for p in profile["per_prompt"]]
    prompts = wandb.Table(columns=["id", "category", "turn", "prompt_tokens", "new_tokens", "tau", "greedy_match",
                                   *[f"{m}_s" for m in methods]], data=rows)
    images = {f"plots/{p.stem}": wandb.Image(str(p)) for p in plots}
    run.log({**scalars, "eval/by_category": by_cat, "eval/prompts": prompts, **images})
    run.summary.update(scalars)
    run.finish()


def write_samples(samples: Sequence[Sample], out_dir: Path) -> Path:
    """outputs.jsonl: one line per decoded prompt, each method's output token ids (what every figure was measured
    on)."""
    path = out_dir / "outputs.jsonl"
    _write_text(path, "".join(json.dumps({"id": s.id, "category": s.category, "turn": s.turn,
                                          "prompt_tokens": s.prompt_tokens, "outputs": s.outputs}) + "\n"
                              for s in samples))
    return path


def write_outputs(
    samples: Sequence[Sample], meta: Mapping[str, Any], setting: Mapping[str, Any], depths: Mapping[str, int],
    out_dir: Path, wandb_cfg: Mapping[str, Any] | None = None, console: Console | None = None,
    peers: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The one report writer: report.json, outputs.jsonl and the plots to out_dir, the tables printed; returns the
    report. `depths`: each drafter's deepest draft by method label, so positions never accepted show as 0.

    A single-family run (`speculative`, and the parts of a combination measured alone beside it, `drafter_alone` and
    `grafted_alone`) also writes profile.json and logs to W&B; `peers`: serving engines measured on the same prompts
    (eval.serving), reported as `engine_peers`. method=all (meta["method"] == "all") writes one row per family
    (build_families) and families.png."""
    console = console or Console()
    if meta["method"] == "all":
        families = build_families(samples, meta, depths)
        chart = out_dir / "families.png"
        write_report_files(out_dir, [
            ("report.json", lambda: write_json(out_dir / "report.json", families)),
            ("outputs.jsonl", lambda: write_samples(samples, out_dir)),
            ("families.png", lambda: save_chart(families["methods"], f"{meta['verifier']}, {len(samples)} prompts",
                                                chart))])
        print_families(families, samples, console)
        console.print(f"report: {out_dir / 'report.json'}, chart: {chart}")
        return families
    alone_depths = {m: d for m, d in depths.items() if m in (ALONE, GRAFTED)}
    report = build_report(samples, meta, depths[SPECULATIVE], alone_depths)
    if peers:
        report["engine_peers"] = dict(peers)
    profile = build_profile(samples, setting)
    plots: list[Path] = []
    written = write_report_files(out_dir, [
        ("report.json", lambda: write_json(out_dir / "report.json", report)),
        ("profile.json", lambda: write_json(out_dir / "profile.json", profile)),
        ("outputs.jsonl", lambda: write_samples(samples, out_dir)),
        ("the plots", lambda: plots.extend(save_plots(samples, report, out_dir)))])
    plots += [Path(p["plot"]) for p in (peers or {}).values() if p.get("plot")]  # a load sweep's (eval.serving.sweep)
    print_summary(report, profile, console)
    wandb_cfg = dict(wandb_cfg or {})
    try:
        log_wandb(report, profile, plots, out_dir, wandb_cfg.get("mode"), wandb_cfg.get("project", "specdraft"),
                  wandb_cfg.get("name"))
    except Exception as e:
        if not disk_full(e):
            raise
        raise disk_full_error(out_dir, "logging the run to W&B", f"The report is written whole ({', '.join(written)} "
                              f"in {out_dir}); the W&B run under {out_dir / 'wandb'} is incomplete. "
                              f"(wandb.mode=disabled skips W&B.)") from e
    console.print(f"report: {out_dir / 'report.json'}")
    return report

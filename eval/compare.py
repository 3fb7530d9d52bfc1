"""`python -m eval method=all`: every drafter family available, on the same prompts, in one process, interleaved per
prompt so they share the machine's state; one table (tau, tokens/s, speedup over our plain greedy, exactness) overall
and per category, report.json with those rows, and a bar chart (families.png).

Available families: each export in `checkpoint` (one, or a list: its kind, Medusa / EAGLE / EAGLE-3, under conf/tree)
and the hybrid on the first export; always the draft model (a truncated verifier), prompt lookup and lookahead. The
family named by `drafter=` keeps its command-line options; the others take conf/drafter/<name>.yaml as it is.
Outside references: Hugging Face greedy `generate`, its prompt lookup, and its assisted generation with the same
draft model as `assistant_model` (a constant `num_assistant_tokens` = the draft model's depth).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table
from torch import Tensor

from data.prompts import load_conversations, select_prompts
from eval import cost
from eval.accept import mean_accept_length
from eval.decode import greedy_decode, speculative_decode
from eval.drafters import Drafter
from eval.families import family_config, method_name
from eval.harness import Runner, assistant_of, verifier_source_of, build_drafter, family_of, run_prompts
from eval.report import Sample
from eval.tree import AutoTree
from models.errors import UserError
from models.export import export_kind, read_config
from models.verifier import Verifier, load_verifier

REFERENCES = ("hf_generate", "hf_prompt_lookup", "hf_assisted")


@dataclass
class FamilySample(Sample):
    """A Sample whose speculative methods are many: `lengths` holds each family's accepted drafts per round."""

    lengths: dict[str, Tensor] = field(default_factory=dict)


class FamilyRunner:
    """Decodes one prompt with plain greedy, every family and the references, in a fixed interleaved order; the same
    `decode` as eval.harness.Runner, so eval.harness.run_prompts drives it (multi-turn included)."""

    def __init__(self, verifier: Verifier, drafters: dict[str, Drafter], max_new_tokens: int, lookup: int,
                 assistant: Any | None = None, assistant_tokens: int = 4) -> None:
        self.hf = Runner(verifier, next(iter(drafters.values())), max_new_tokens, lookup,
                         assistant=assistant, assistant_tokens=assistant_tokens)
        self.verifier, self.drafters, self.max_new = verifier, drafters, max_new_tokens

    def decode(self, ids: list[int], prompt_id: str = "", category: str = "", turn: int = 0) -> FamilySample:
        x = torch.tensor([ids], device=self.verifier.device)  # (1, T)
        v, n, eos = self.verifier, self.max_new, self.hf.eos
        calls: dict[str, Any] = {"baseline": lambda: greedy_decode(v, x, n, eos)}
        for name, drafter in self.drafters.items():
            calls[name] = lambda d=drafter: speculative_decode(v, d, x, n, eos)
        calls["hf_generate"] = lambda: self.hf._hf(x, self.hf.hf_config)
        calls["hf_prompt_lookup"] = lambda: self.hf._hf(x, self.hf.lookup_config)
        if self.hf.assistant is not None:
            calls["hf_assisted"] = lambda: self.hf._assisted(x)
        seconds, outputs, results = {}, {}, {}
        for method, call in calls.items():
            self.hf._sync()
            start = time.perf_counter()
            out = call()
            self.hf._sync()
            seconds[method] = time.perf_counter() - start
            if isinstance(out, list):
                outputs[method] = out
            else:
                results[method], outputs[method] = out, out.tokens[0].tolist()
        lengths = {m: r.accept_lengths[:, 0].cpu() for m, r in results.items() if m != "baseline"}
        return FamilySample(
            id=prompt_id, category=category, turn=turn, prompt_tokens=len(ids), seconds=seconds, outputs=outputs,
            accept_lengths=next(iter(lengths.values())), forwards={m: r.num_forwards for m, r in results.items()},
            times={m: r.times for m, r in results.items()}, lengths=lengths,
        )


def rows(samples: Sequence[FamilySample], methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per method: tau (families only), tokens/s (all tokens over all seconds), speedup over our plain greedy, and
    the fraction of prompts whose output equals plain greedy's token for token."""
    def rate(m: str) -> float:
        secs = sum(s.seconds[m] for s in samples)
        return sum(len(s.outputs[m]) for s in samples) / secs if secs > 0 else 0.0

    base = rate("baseline")
    out = {}
    for m in ("baseline", *methods):
        tau = None
        if samples and m in samples[0].lengths:
            tau = round(mean_accept_length(torch.cat([s.lengths[m] for s in samples])), 4)
        out[m] = {"tau": tau, "tokens_per_s": round(rate(m), 2),
                  "speedup": round(rate(m) / base, 4) if base else 0.0,
                  "greedy_match": round(sum(s.matches(m) for s in samples) / max(len(samples), 1), 4)}
    return out


def build_drafters(cfg: DictConfig, verifier: Verifier, exports: list[Path]) -> dict[str, Drafter]:
    """Every family available, by method label (e.g. `medusa/auto-16`)."""
    chosen = family_of(cfg.drafter)
    families: list[tuple[str, Any, Path | None]] = []
    for export in exports:
        kind = export_kind(read_config(export))
        if kind is None:
            raise UserError(f"checkpoint {str(export)!r} is neither a Medusa nor an EAGLE export.")
        families.append((kind, OmegaConf.create({"_target_": "eval.families.export", "_partial_": True,
                                                 "kind": kind}), export))
    for name in ("draft_model", "prompt_lookup", "lookahead") + (("hybrid",) if exports else ()):
        families.append((name, cfg.drafter if name == chosen else family_config(name),
                         exports[0] if exports else None))
    policy = instantiate(cfg.tree, _convert_="all")
    if isinstance(policy, AutoTree) and policy.size == "auto":  # one budget for every family, so they compare
        print(f"[eval] method=all compares every family at one node budget: tree.size=auto drafts "
              f"{cost.FALLBACK_SIZE} nodes here. Give tree.size=N to choose.")
        policy = AutoTree(size=cost.FALLBACK_SIZE)
    drafters = {}
    for name, drafter_cfg, export in families:
        drafter = build_drafter(cfg, drafter_cfg, verifier, export, policy)
        drafters[method_name(name, drafter)] = drafter
    return drafters


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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare(cfg: DictConfig, progress: bool = True) -> dict[str, Any]:
    """method=all: build every family, decode every prompt with each, write report.json and families.png."""
    raw = cfg.checkpoint
    exports = [] if raw is None else [Path(str(p)).expanduser() for p in (raw if OmegaConf.is_list(raw) else [raw])]
    convs = select_prompts(load_conversations(str(cfg.prompts), split="eval"), cfg.num_prompts)
    verifier = load_verifier(verifier_source_of(cfg, exports[0] if exports else None), str(cfg.dtype),
                             str(cfg.device), cfg.get("cache_dir"))
    drafters = build_drafters(cfg, verifier, exports)
    assistant, depth = next((assistant_of(d) for d in drafters.values() if assistant_of(d)[0] is not None), (None, 0))
    runner = FamilyRunner(verifier, drafters, int(cfg.max_new_tokens), int(cfg.prompt_lookup_num_tokens),
                          assistant, depth)
    samples = run_prompts(runner, convs, bool(cfg.multi_turn), bool(cfg.warmup), progress)
    methods = [*drafters, *(r for r in REFERENCES if samples and r in samples[0].outputs)]
    categories = sorted({s.category for s in samples})
    report = {
        "method": "all", "verifier": verifier.name, "checkpoint": [str(e) for e in exports],
        "num_prompts": len(samples), "max_new_tokens": int(cfg.max_new_tokens), "threads": int(cfg.threads),
        "dtype": str(cfg.dtype), "trees": {m: d.describe() for m, d in drafters.items()},
        "methods": rows(samples, methods),
        "by_category": {c: rows([s for s in samples if s.category == c], methods) for c in categories},
    }
    out_dir = Path(str(cfg.output_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    save_chart(report["methods"], f"{verifier.name}, {len(samples)} prompts", out_dir / "families.png")
    console = Console()
    table = Table(title=f"every family on {len(samples)} prompts ({verifier.name})")
    for col in ("method", "tau", "tokens/s", "speedup", "exact"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m, r in report["methods"].items():
        table.add_row(m, "-" if r["tau"] is None else f"{r['tau']:.2f}", f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['greedy_match']:.0%}")
    console.print(table)
    console.print(f"report: {out_dir / 'report.json'}, chart: {out_dir / 'families.png'}")
    return report

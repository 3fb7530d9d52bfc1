"""Acceptance rate against KL(q || p) over drafts of graded quality: the rule measured beside alpha = sum min(p, q).

    # SmolLM2, 4 built-in eval prompts
    python -m scripts.studies.acceptance_vs_kl --out outputs/theory
    # the random 2-layer test verifier, seconds
    python -m scripts.studies.acceptance_vs_kl --verifier tiny --out /tmp/kl

The verifier M_q answers a few built-in eval prompts greedily; its next-token distributions q at every answer
position (temperature 1, the whole vocabulary unless --top-k) are the contexts. Each q is perturbed into drafts p of
graded quality, two families: p = softmax(log q + sigma * noise) (one fixed Gaussian noise per context, growing sigma)
and p = (1 - lam) q + lam * uniform. For each draft, alpha is measured by running
eval.engine.acceptance.sampled.sample_accept on
--samples drafts d ~ p per context (fixed seed) and printed beside the closed form and KL(q || p), both averaged over
contexts (eval/theory.py). Writes acceptance_vs_kl.png and acceptance_vs_kl.json to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor

from data.chat import prompt_ids
from data.prompts import load_conversations
from eval.engine.sampling import warp
from eval.theory import acceptance_rate, kl_divergence, measure_acceptance, mix_uniform, perturb
from models.verifiers.core import Verifier
from models.verifiers.load import load_verifier
from models.verifiers.tiny import build_tiny
from scripts.common import add_theory_args, save_figure, subplots

SIGMAS = [0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
LAMS = [0.0, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 0.95]


@torch.no_grad()
def verifier_contexts(verifier: Verifier, num_prompts: int, answer_tokens: int, top_k: int) -> Tensor:
    """q at every position of M_q's greedy answers to the first built-in eval prompts. (C, V) float64"""
    qs = []
    for conv in load_conversations("builtin", split="eval", limit=num_prompts):
        ids = torch.tensor([prompt_ids(verifier.tokenizer, conv.messages[:1])])
        full = verifier.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=answer_tokens,
                                       do_sample=False, pad_token_id=verifier.tokenizer.pad_token_id)
        logits = verifier.model(full).logits[0, ids.shape[1] - 1 : -1, : verifier.vocab_size]  # (T, V)
        qs.append(warp(logits, 1.0, top_k=top_k).double())
    return torch.cat(qs)


def graded(q: Tensor, family: str, grades: list[float], samples: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    rows = []
    for g in grades:
        p = perturb(q, g, noise) if family == "noise" else mix_uniform(q, g)
        measured, sd = measure_acceptance(p, q, samples, gen)
        rows.append({"family": family, "grade": g, "kl": max(0.0, float(kl_divergence(q, p).mean())),
                     "alpha_closed": float(acceptance_rate(p, q).mean()), "alpha_measured": measured, "sd": sd})
    return rows


def monotone(rows: list[dict]) -> bool:
    """Closed-form alpha falls as KL grows along the family (grades in increasing order)."""
    return all(b["kl"] > a["kl"] and b["alpha_closed"] < a["alpha_closed"] for a, b in zip(rows, rows[1:]))


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = subplots(figsize=(6.5, 4.2))
    for family, color, label in (("noise", "C0", "softmax(log q + sigma*noise)"), ("mix", "C1", "(1-lam) q + lam U")):
        fam = [r for r in rows if r["family"] == family]
        kl = [r["kl"] for r in fam]
        ax.plot(kl, [r["alpha_closed"] for r in fam], "-", color=color, label=f"{label}: closed form")
        ax.errorbar(kl, [r["alpha_measured"] for r in fam], yerr=[3 * r["sd"] for r in fam], fmt="o", color=color,
                    ms=4, capsize=2, label=f"{label}: measured (±3 sd)")
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlabel("KL(q || p) [nats], mean over contexts")
    ax.set_ylabel("acceptance rate alpha")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="smollm2", help="smollm2, tiny (a random 2-layer Llama), or a checkpoint")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=32, help="contexts per prompt")
    ap.add_argument("--top-k", type=int, default=50, help="warp q (and so p) to its top-k tokens (50: HF generate's "
                    "default); 0: the whole vocabulary, about 100x slower to measure")
    ap.add_argument("--samples", type=int, default=64, help="drafts d ~ p drawn per context")
    ap.add_argument("--sigmas", type=float, nargs="+", default=SIGMAS)
    ap.add_argument("--lams", type=float, nargs="+", default=LAMS)
    ap.add_argument("--seed", type=int, default=0)
    add_theory_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import os

    cache = args.cache_dir or os.environ.get("SPECDRAFT_CACHE")
    verifier = (build_tiny(cache_dir=cache, device="cpu", layer_std=0.3) if args.verifier == "tiny"
                else load_verifier(args.verifier, "float32", "cpu", cache))
    q = verifier_contexts(verifier, args.num_prompts, args.answer_tokens, args.top_k)
    rows = graded(q, "noise", sorted(args.sigmas), args.samples, args.seed)
    rows += graded(q, "mix", sorted(args.lams), args.samples, args.seed + 1)

    print(f"{verifier.name}: {q.shape[0]} contexts x {args.samples} drafts each, vocabulary {q.shape[1]}"
          f"{f', top-k {args.top_k}' if args.top_k else ''}, seed {args.seed}")
    print(f"{'family':<6} {'grade':>6} {'KL(q||p)':>9} {'alpha':>7} {'measured':>9} {'sd':>7} {'z':>6}")
    for r in rows:
        z = (r["alpha_measured"] - r["alpha_closed"]) / r["sd"] if r["sd"] > 1e-9 else 0.0
        print(f"{r['family']:<6} {r['grade']:>6.2f} {r['kl']:>9.4f} {r['alpha_closed']:>7.4f} "
              f"{r['alpha_measured']:>9.4f} {r['sd']:>7.4f} {z:>6.2f}")
    for family in ("noise", "mix"):
        print(f"{family}: closed-form alpha strictly decreasing in KL: "
              f"{monotone([r for r in rows if r['family'] == family])}")
    worst = max(abs(r["alpha_measured"] - r["alpha_closed"]) / r["sd"] for r in rows if r["sd"] > 1e-9)
    print(f"largest |measured - closed| / sd: {worst:.2f}")

    args.out.mkdir(parents=True, exist_ok=True)
    title = f"{verifier.name}, {q.shape[0]} contexts x {args.samples} drafts (seed {args.seed})"
    plot(rows, args.out / "acceptance_vs_kl.png", title)
    (args.out / "acceptance_vs_kl.json").write_text(json.dumps({"verifier": verifier.name, "rows": rows}, indent=1))
    print(f"wrote {args.out / 'acceptance_vs_kl.png'} and acceptance_vs_kl.json")


if __name__ == "__main__":
    main()

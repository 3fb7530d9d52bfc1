"""Tokens per verifier call and wall-clock speedup against the draft length N, closed form beside measured rounds.

    python -m scripts.studies.tokens_per_call --out outputs/theory              # measures c: SmolLM2[:1] step / SmolLM2
    python -m scripts.studies.tokens_per_call --c 0.05 --out /tmp/tau           # a given cost ratio, no model loaded

For each alpha (default 0.5, 0.7, 0.85): E[tau] = (1 - alpha^(N+1)) / (1 - alpha) beside the mean of --rounds rounds
of eval.engine.acceptance.sampled.sample_accept on a chain of N drafts drawn i.i.d. from p and checked against q,
where (p, q) is the two-point pair of eval/theory.py with sum min(p, q) = alpha. Speedup is Leviathan et al. (2023),
Theorem 3.8: E[tau] / (1 + N c), which assumes a verifier forward over N + 1 tokens costs what a one-token forward does.

c = t(one cached M_p step) / t(one cached M_q forward) is measured here, side by side in one process (interleaved,
median of --reps): M_q is SmolLM2-135M, M_p the truncated-verifier draft model of eval/drafters/draft_model.py (its
first --draft-layers layers, final norm and lm_head). Prints the tables and the best N per alpha; writes
tokens_per_call.png and tokens_per_call.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from eval.theory import (
    best_draft_length,
    expected_tokens,
    measure_tokens_per_call,
    speedup,
    tokens_variance,
    two_point_pair,
)
from scripts.common import add_theory_args, save_figure, subplots


@torch.no_grad()
def measure_c(layers: int, context: int, reps: int, cache_dir: str | None) -> dict:
    """Median time of one cached one-token forward of the draft model and of the verifier, after `context` tokens."""
    from eval.drafters.draft_model import truncated_copy
    from eval.engine import hf_forward as kv
    from models.verifiers.load import load_verifier

    verifier = load_verifier("smollm2", "float32", "cpu", cache_dir)
    draft = truncated_copy(verifier, layers)
    ids = torch.randint(100, verifier.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    step = ids[:, -1:]
    models = {"draft": draft, "verifier": verifier.model}
    caches = {}
    for name, model in models.items():
        caches[name] = kv.new_cache()
        kv.forward(model, caches[name], ids)  # prefill
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(reps + 3):
        for name, model in models.items():  # interleaved, so load on a shared machine hits both alike
            t0 = time.perf_counter()
            kv.forward(model, caches[name], step)
            dt = time.perf_counter() - t0
            kv.commit(caches[name], context, torch.zeros(1, 0, dtype=torch.long))  # drop the step: same length
            if i >= 3:  # warm-up
                times[name].append(dt)
    t_draft, t_verifier = statistics.median(times["draft"]), statistics.median(times["verifier"])
    return {"c": t_draft / t_verifier, "t_draft_ms": 1e3 * t_draft, "t_verifier_ms": 1e3 * t_verifier,
            "draft": f"{verifier.name}[:{layers}]", "verifier": verifier.name, "context": context, "reps": reps}


def plot(rows: list[dict], alphas: list[float], c: float, best: dict, path: Path, note: str) -> None:
    fig, (left, right) = subplots(1, 2, figsize=(11, 4.2))
    for i, a in enumerate(alphas):
        mine = [r for r in rows if r["alpha"] == a]
        ns = [r["n"] for r in mine]
        left.plot(ns, [r["closed"] for r in mine], "-", color=f"C{i}", label=f"alpha={a}: closed form")
        left.errorbar(ns, [r["measured"] for r in mine], yerr=[3 * r["se"] for r in mine], fmt="o", ms=4,
                      color=f"C{i}", capsize=2, label=f"alpha={a}: measured (±3 se)")
        right.plot(ns, [r["speedup"] for r in mine], "-o", ms=3, color=f"C{i}", label=f"alpha={a}")
        n_best, s_best = best[a]
        right.plot([n_best], [s_best], "*", ms=14, color=f"C{i}")
        right.annotate(f"N={n_best}", (n_best, s_best), textcoords="offset points", xytext=(4, 6), fontsize=8)
    left.set_xlabel("draft length N")
    left.set_ylabel("tokens per verifier call E[tau]")
    left.legend(fontsize=7)
    right.axhline(1, color="gray", lw=0.8, ls=":")
    right.set_xlabel("draft length N")
    right.set_ylabel("speedup E[tau] / (1 + N c)")
    right.set_title(f"c = {c:.3f} ({note})\n* = best N", fontsize=8)
    right.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.7, 0.85])
    ap.add_argument("--n-max", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=20000, help="measured rounds per (alpha, N)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--c", type=float, default=None, help="cost ratio draft step / verifier forward; measured if unset")
    ap.add_argument("--draft-layers", type=int, default=1, help="layers of the truncated-verifier draft model")
    ap.add_argument("--context", type=int, default=256, help="tokens in the KV cache when c is timed")
    ap.add_argument("--reps", type=int, default=40)
    add_theory_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.c is None:
        timing = measure_c(args.draft_layers, args.context, args.reps,
                           args.cache_dir or os.environ.get("SPECDRAFT_CACHE"))
        c, note = timing["c"], f"measured, {timing['draft']} vs {timing['verifier']}"
        print(f"c = {c:.4f}: {timing['draft']} step {timing['t_draft_ms']:.2f} ms / {timing['verifier']} forward "
              f"{timing['t_verifier_ms']:.2f} ms (median of {args.reps}, one token after {args.context} cached, "
              f"{args.threads} threads)")
    else:
        c, note, timing = args.c, "given with --c", None
        print(f"c = {c} (given)")

    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for a in args.alphas:
        p, q = two_point_pair(a)
        for n in range(args.n_max + 1):
            measured, se = measure_tokens_per_call(p, q, n, args.rounds, gen)
            rows.append({"alpha": a, "n": n, "closed": expected_tokens(a, n), "measured": measured, "se": se,
                         "sd_closed": (tokens_variance(a, n) / args.rounds) ** 0.5, "speedup": speedup(a, n, c)})
    best = {a: best_draft_length(a, c, args.n_max) for a in args.alphas}

    head = "".join(f" | a={a}: closed  measured   z  speedup" for a in args.alphas)
    print(f"tokens per verifier call ({args.rounds} rounds each, seed {args.seed}) and speedup E[tau]/(1+N c)")
    print(f"{'N':>3}{head}")
    for n in range(args.n_max + 1):
        line = f"{n:>3}"
        for a in args.alphas:
            r = next(r for r in rows if r["alpha"] == a and r["n"] == n)
            z = (r["measured"] - r["closed"]) / r["sd_closed"] if r["sd_closed"] > 0 else 0.0
            line += f" | {r['closed']:>13.4f} {r['measured']:>9.4f} {z:>4.1f} {r['speedup']:>8.3f}"
        print(line)
    for a in args.alphas:
        print(f"alpha={a}: best N = {best[a][0]}, speedup {best[a][1]:.3f} at c = {c:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.alphas, c, best, args.out / "tokens_per_call.png", note)
    (args.out / "tokens_per_call.json").write_text(json.dumps(
        {"c": c, "timing": timing, "rows": rows, "best": {str(a): b for a, b in best.items()}}, indent=1))
    print(f"wrote {args.out / 'tokens_per_call.png'} and tokens_per_call.json")


if __name__ == "__main__":
    main()

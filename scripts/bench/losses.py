"""The acceptance losses' cost beside kl's, measured side by side in one run (train/losses.py).

    python -m scripts.bench.losses                  # SmolLM2's shapes: V 49,152 through the frozen head, D 576
    python -m scripts.bench.losses --rows 512 --repeats 5

Two drivers, as the families call them: `frozen_head_loss` (EAGLE-1, DFlash: logits = hidden @ W^T, chunk by chunk)
over the full vocabulary, and `chunked_loss` (EAGLE-3, P-EAGLE: logits in hand) over an 8,192-token draft
vocabulary. Prints, per loss, the median forward + backward seconds and the ratio to kl's (round-robin repeats).
bf16 inputs, as training holds them; random weights (cost does not depend on what was learned).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from train.losses import LOSSES, chunked_loss, frozen_head_loss


def _times(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds per function, the functions taken in turn within each repeat (round-robin), so a machine
    whose load drifts slows them alike."""
    for fn in fns.values():
        fn()  # warm-up
    seen: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            seen[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256, help="positions per call")
    ap.add_argument("--vocab", type=int, default=49152, help="the verifier's vocabulary (frozen head)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="the draft vocabulary (chunked_loss)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(dt)
    hidden = torch.randn(args.rows, args.hidden, generator=g).to(dt)
    teacher = torch.randn(args.rows, args.hidden, generator=g).to(dt)
    logits = (torch.randn(args.rows, args.draft_vocab, generator=g) * 3).to(dt)
    q = (torch.randn(args.rows, args.draft_vocab, generator=g) * 3).softmax(-1)

    def head(name: str) -> None:
        h = hidden.clone().requires_grad_(True)
        frozen_head_loss(h, weight, teacher=teacher, loss=name, want_alpha=False)[0].sum().backward()

    def soft(name: str) -> None:
        z = logits.clone().requires_grad_(True)
        chunked_loss(z, q, loss=name, want_alpha=False)[0].sum().backward()

    print(f"rows {args.rows}, torch threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'loss':<10} {'frozen head V=' + str(args.vocab):>24} {'ratio':>6} "
          f"{'chunked V=' + str(args.draft_vocab):>20} {'ratio':>6}")
    fns = {(d, n): (lambda d=d, n=n: head(n) if d == "head" else soft(n)) for n in LOSSES for d in ("head", "soft")}
    t = _times(fns, args.repeats)
    for name in LOSSES:
        a, b = t["head", name], t["soft", name]
        print(f"{name:<10} {a:>22.3f} s {a / t['head', 'kl']:>6.2f} {b:>18.3f} s {b / t['soft', 'kl']:>6.2f}")


if __name__ == "__main__":
    main()

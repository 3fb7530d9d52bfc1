"""The acceptance losses' cost beside kl's, measured side by side in one run (train/losses.py).

    python -m scripts.bench.losses                  # SmolLM2's shapes: V 49,152 through the frozen head, D 576
    python -m scripts.bench.losses --rows 512 --repeats 5

Two drivers, as the families call them: `frozen_head_loss` (EAGLE-1, DFlash: logits = hidden @ W^T, chunk by chunk)
over the full vocabulary, and `chunked_loss` (EAGLE-3, P-EAGLE: logits in hand) over an 8,192-token draft
vocabulary. Prints, per loss, the median forward + backward seconds and the ratio to kl's. bf16 inputs, as training
holds them; random weights (cost does not depend on what was learned).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from train.losses import LOSSES, chunked_loss, frozen_head_loss


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    base: tuple[float, float] | None = None
    for name in LOSSES:
        a, b = _time(lambda: head(name), args.repeats), _time(lambda: soft(name), args.repeats)
        base = base or (a, b)
        print(f"{name:<10} {a:>22.3f} s {a / base[0]:>6.2f} {b:>18.3f} s {b / base[1]:>6.2f}")


if __name__ == "__main__":
    main()

"""Drafting cost per round, EAGLE's bounded frontier against EAGLE-2's rule, side by side in one process.

    python -m scripts.bench.draft outputs/eagle-lc240k/export [--dtype bfloat16] [--threads 1] [--rounds 5]

For an EAGLE export on the default verifier: the draft curve (eval.planner.cost.draft_curve: ms of one round's drafting
for s drafts after a real prefix) with the frontier bounded as `propose` does it, and with EAGLE-2's rule (the topk best
nodes of every layer), interleaved round by round; and the drafter rows each computes. The trees are the same (the
script checks). Prints ratios; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from data.prompts import load_conversations
from data.selfdistill import prompt_ids
from eval.drafters.build import export
from eval.engine.session import VerifierSession
from eval.engine.timing import interleaved
from eval.engine.tree import DynamicTree
from models.verifiers.embedded import load_smollm2

SIZES = (2, 4, 8, 16, 24, 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--topk", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    verifier = load_smollm2(dtype=args.dtype, device="cpu")
    conv = load_conversations("builtin", split="eval", limit=1)[0]
    prefix = torch.tensor([prompt_ids(verifier.tokenizer, conv.messages)])
    drafter = export(verifier, DynamicTree(size=max(SIZES), depth=args.depth, topk=args.topk), args.export)
    cache = VerifierSession(verifier, "auto", prefix.shape[1] + 1, 1, 1)
    hidden = cache.forward(prefix, layers=drafter.feature_layers).hidden
    seq = torch.cat([prefix, prefix[:, -1:]], dim=1)
    root_out = drafter._extend(seq, hidden)
    rows = {}
    for n in SIZES:
        bounded = drafter._expand(root_out, drafter.depth, drafter.topk, n)
        rows[(n, True)] = drafter.rows_fed
        full = drafter._expand(root_out, drafter.depth, drafter.topk, n, bound_frontier=False)
        rows[(n, False)] = drafter.rows_fed
        assert bounded[0] == full[0] and torch.equal(bounded[1], full[1]), n
    fns = [lambda n=n, b=b: drafter._expand(root_out, drafter.depth, drafter.topk, n, bound_frontier=b)
           for n in SIZES for b in (True, False)]
    runs = [interleaved(fns, 1) for _ in range(args.rounds)]
    med = [statistics.median(r[i] for r in runs) for i in range(len(fns))]
    print(f"{args.export}: {args.dtype}, {args.threads} thread(s), depth {drafter.depth}, topk {drafter.topk}, "
          f"prefix {prefix.shape[1]}, median of {args.rounds} interleaved rounds")
    print(f"{'drafts':>6} {'bounded ms':>11} {'rows':>5} {'EAGLE-2 rule ms':>16} {'rows':>5} {'ratio':>6}")
    for i, n in enumerate(SIZES):
        b, f = med[2 * i], med[2 * i + 1]
        print(f"{n:>6} {b:>11.1f} {rows[(n, True)]:>5} {f:>16.1f} {rows[(n, False)]:>5} {f / b:>5.2f}x")


if __name__ == "__main__":
    main()

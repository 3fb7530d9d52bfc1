"""The verifier's forward cost for 1..64 tokens beside this machine's bound, without an export (eval.planner.cost).

    python -m scripts.tools.cost_curve [--verifier smollm2] [--dtype float32 bfloat16] [--threads 1 2] [--engine auto]
        [--out outputs/cost_curve]

The prefix is the first built-in eval prompt through the chat template. `python -m eval ... profile=true` writes the
same curves for a run; `tree.size=auto` picks a tree from them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from data.chat import prompt_ids
from data.prompts import load_conversations, select_prompts
from eval.planner import cost
from models.verifiers.load import load_verifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="smollm2")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--engine", default="auto", choices=["auto", "engine", "hf"])
    ap.add_argument("--out", default="outputs/cost_curve")
    args = ap.parse_args()
    curves = []
    for dtype in args.dtype:
        verifier = load_verifier(args.verifier, dtype, "cpu")
        conv = select_prompts(load_conversations("builtin", split="eval"), 1)[0]
        first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        prefix = torch.tensor([prompt_ids(verifier.tokenizer, conv.messages[: first_user + 1])])
        for threads in args.threads:
            c = cost.measure(verifier, prefix, threads, args.engine)
            curves.append(c)
            bound = [max(m, f) for m, f in zip(c.bound_memory_ms, c.bound_compute_ms)]
            print(f"{dtype}, {threads} thread(s), {c.path}, prefix {prefix.shape[1]}: " + ", ".join(
                f"{n}:{t:.0f}" for n, t in zip(c.sizes, c.ms)) + f" ms; bound {bound[0]:.1f}..{bound[-1]:.1f} ms "
                f"({c.machine['read_gbs']:.1f} GB/s, {c.machine['peak_gflops'][dtype]:.0f} GFLOP/s)")
    for path in cost.write(curves, Path(args.out)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""How much of the training targets EAGLE-3's draft vocabulary covers, per verifier vocabulary, on the same text.

    python -m scripts.studies.draft_vocab_coverage [--sizes 2048 8192 32000 65536] [--held-out 0.1]

The text is the assistant side of the shipped self-distilled set (shipped/data/smollm2-selfdistill-v1, 2.6M SmolLM2
tokens), decoded, and tokenised again by each embedded verifier's tokenizer (SmolLM2: 49,152 tokens; Gemma 3:
262,144). For each draft vocabulary size N, the N most frequent target tokens of the training rows (as
train/eagle.py picks them) and the share of the held-out rows' target tokens they cover: a drafter never proposes a
token outside its draft vocabulary, so that share bounds its acceptance.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from models.verifiers.embedded import ensure_gemma3_checkpoint, ensure_smollm2_checkpoint, local_tokenizer

SHIPPED = Path(__file__).resolve().parents[2] / "shipped" / "data" / "smollm2-selfdistill-v1"


def coverage(rows: list[list[int]], vocab: int, train: np.ndarray, sizes: list[int]) -> dict[int, tuple[float, float]]:
    """N -> (share of training targets, share of held-out targets) in the N most frequent training targets."""
    counts = np.bincount(np.concatenate([rows[i] for i in np.flatnonzero(train)]), minlength=vocab)
    held = np.bincount(np.concatenate([rows[i] for i in np.flatnonzero(~train)]), minlength=vocab)
    order = np.argsort(-counts, kind="stable")
    return {n: (counts[order[:n]].sum() / counts.sum(), held[order[:n]].sum() / held.sum()) for n in sizes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 32000, 65536])
    ap.add_argument("--held-out", type=float, default=0.1)
    args = ap.parse_args()
    frame = pd.concat([pd.read_parquet(f) for f in sorted(SHIPPED.glob("part-*.parquet"))])
    smol = local_tokenizer(ensure_smollm2_checkpoint())
    gemma = local_tokenizer(ensure_gemma3_checkpoint())
    answers = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(frame["input_ids"], frame["loss_mask"])]
    texts = smol.batch_decode(answers, skip_special_tokens=False)
    rows = {"SmolLM2-135M-Instruct": (answers, len(smol)),
            "gemma-3-270m": (gemma(texts, add_special_tokens=False)["input_ids"], len(gemma))}
    train = np.random.default_rng(0).random(len(answers)) >= args.held_out
    print(f"{len(answers)} answers ({int(train.sum())} train / {int((~train).sum())} held out)")
    print("| verifier | vocabulary | target tokens | distinct | " + " | ".join(f"N={n}" for n in args.sizes) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(args.sizes))
    for name, (ids, vocab) in rows.items():
        cov = coverage([np.asarray(r, dtype=np.int64) for r in ids], vocab, train, args.sizes)
        total = sum(len(r) for r in ids)
        distinct = len(set(t for r in ids for t in r))
        cells = " | ".join(f"{100 * c[0]:.2f}% / {100 * c[1]:.2f}%" for c in cov.values())
        print(f"| {name} | {vocab:,} | {total:,} | {distinct:,} | {cells} |")
    print("cells: train coverage / held-out coverage of the N most frequent training targets")


if __name__ == "__main__":
    main()

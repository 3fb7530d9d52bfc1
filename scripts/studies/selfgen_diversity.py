"""What seed topics change in self-generated (Magpie) prompts, measured side by side on the same verifier.

    python -m scripts.studies.selfgen_diversity --num 64            # default verifier, bf16, T=1, top-p 0.95

For plain Magpie (no topic) and for topics named in the system prompt (`data.selfgen.topics=builtin`): how many of
`num` samples pass the filters, distinct-4 (distinct word 4-grams / all 4-grams) over the kept prompts, and the number
of near-duplicate clusters (word 3-gram Jaccard >= 0.5) among them; plus a few samples of each.
"""

from __future__ import annotations

import argparse
import os
import time

from data.filters import QualityFilter, apply_filters, count_clusters, distinct_ngrams
from data.selfgen import TOPICS, generate_prompts
from scripts.common import add_verifier_args, load_cpu_verifier, set_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    add_verifier_args(ap)
    args = ap.parse_args()
    set_threads(args)
    verifier = load_cpu_verifier(args, "bfloat16")
    rows = []
    for name, topics in (("plain Magpie", None), ("32 seed topics", TOPICS)):
        t0 = time.perf_counter()
        recs = generate_prompts(verifier, args.num, 1.0, 0.95, args.max_new_tokens, args.batch_size, seed=0,
                                topics=topics)
        secs = time.perf_counter() - t0
        texts = [r["prompt"] for r in recs if not r["prompt"].endswith("\u2026")]
        kept = [texts[i] for i in apply_filters(texts, QualityFilter(), None, 0.7, name)]
        rows.append((name, len(texts), len(kept), distinct_ngrams(kept), count_clusters(kept, 0.5), secs))
        print(f"--- {name}: samples")
        for t in kept[:6]:
            print("  *", t[:160].replace("\n", " "))
    print(f"\nverifier={args.verifier} num={args.num} T=1.0 top_p=0.95 load={os.getloadavg()[0]:.1f}")
    print(f"{'':<16}{'finished':>9}{'kept':>6}{'distinct-4':>12}{'clusters@0.5':>14}{'seconds':>9}")
    for name, fin, kept, d4, cl, secs in rows:
        print(f"{name:<16}{fin:>9}{kept:>6}{d4:>12.3f}{cl:>14}{secs:>9.0f}")


if __name__ == "__main__":
    main()

"""Compare greedy rollouts of several exports on the same prompts (docs/results/opd.md).

    python -m scripts.studies.opd_compare outputs/opd/heldout-shipped outputs/opd/heldout-opd \
        outputs/opd/heldout-control

Each argument is a rollout directory (python -m eval.rollout). Prints, per rollout, tau and alpha_k over its rounds
(as eval.engine.acceptance defines them), and against the first: the difference in tau and alpha_1 with a 95% bootstrap
interval over prompts (prompts resampled, each keeping all its rounds). Also checks that every rollout committed the
same tokens for each prompt: greedy output is the verifier's, whichever drafter drafted.
"""

from __future__ import annotations

import argparse

import numpy as np

from data.onpolicy import read_rollout


def per_prompt(lines: list[dict]) -> dict[str, np.ndarray]:
    """prompt id -> its rounds' accept lengths."""
    return {line["id"]: np.asarray(line["accept_lengths"], dtype=float) for line in lines}


def figures(rounds: list[np.ndarray], depth: int) -> tuple[float, list[float]]:
    a = np.concatenate(rounds)
    return float(1 + a.mean()), [float((a >= k).mean()) for k in range(1, depth + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rollouts", nargs="+")
    ap.add_argument("--boot", type=int, default=2000)
    args = ap.parse_args()
    loaded = [read_rollout(r) for r in args.rollouts]
    depth = int(loaded[0][0]["settings"]["depth"])
    ids = [line["id"] for line in loaded[0][1]]
    tokens = {line["id"]: line["input_ids"] for line in loaded[0][1]}
    for (_, lines), name in zip(loaded[1:], args.rollouts[1:]):
        same = sum(tokens.get(line["id"]) == line["input_ids"] for line in lines)
        print(f"{name}: {same} of {len(lines)} prompts committed the same tokens as {args.rollouts[0]}")
    rows = [per_prompt(lines) for _, lines in loaded]
    ids = [i for i in ids if all(i in r for r in rows)]
    rng = np.random.default_rng(0)
    base = [rows[0][i] for i in ids]
    print(f"{len(ids)} prompts; columns: rounds, tau, alpha_1..alpha_{depth}; against the first: d_tau, d_alpha_1 "
          f"(95% bootstrap over prompts)")
    for name, r in zip(args.rollouts, rows):
        mine = [r[i] for i in ids]
        tau, alpha = figures(mine, depth)
        line = f"{name}: {sum(len(m) for m in mine)} rounds, tau {tau:.3f}, alpha " + \
            " ".join(f"{a:.3f}" for a in alpha)
        if r is not rows[0]:
            diffs = []
            for _ in range(args.boot):
                pick = rng.integers(0, len(ids), len(ids))
                t1, a1 = figures([mine[k] for k in pick], depth)
                t0, a0 = figures([base[k] for k in pick], depth)
                diffs.append((t1 - t0, a1[0] - a0[0]))
            d = np.asarray(diffs)
            t0, a0 = figures(base, depth)
            lo, hi = np.percentile(d, [2.5, 97.5], axis=0)
            line += (f"; d_tau {tau - t0:+.3f} [{lo[0]:+.3f}, {hi[0]:+.3f}], d_alpha_1 {alpha[0] - a0[0]:+.3f} "
                     f"[{lo[1]:+.3f}, {hi[1]:+.3f}]")
        print(line)


if __name__ == "__main__":
    main()

"""Teacher-forced acceptance tables: what a drafter would get, measured without running the decode loop.

Every drafter is scored from ranks: rank[d, b, t] is where M_q's token x_{t+d+2} sits in the drafter's depth-(d+1)
distribution at position t (0 = its top-1), given the true tokens before it -- Medusa head d+1 on feature F_t, or
EAGLE's unrolled step d. From them:

- depth-1 top-k coverage: how often x_{t+2} is among the k best at depth 1, what a tree `k` wide at depth 1 catches;
- chain conditional accuracy: P(depth d right | depths < d right) for a chain of top-1 drafts;
- tau of that chain, averaged over positions (what training's `val/estimated_tau` reports) and over simulated decode
  rounds, each round starting where the previous accepted run ended (what `python -m eval tree=chain` measures;
  easy stretches are crossed in fewer rounds, so it is lower when acceptance comes in runs).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

TOPK = (1, 2, 4, 8, 16)


def chain_rounds(lead: Tensor, first: int, last: int) -> tuple[int, int]:
    """Simulate chain decoding over one answer. lead[t]: drafts a chain rooted after position t would get accepted;
    the first round's features end at `first` (the last prompt position; the prefill already gave x_{first+1});
    `last` is the answer's final position. A round at t emits x_{t+2}.. Returns (tokens emitted, rounds); their ratio
    is tau as `eval.decode.DecodeResult.tau` counts it."""
    tokens = rounds = 0
    t = first
    while t + 1 < last:
        step = int(lead[t]) + 1  # accepted drafts + M_q's own token (lead only counts targets inside the answer)
        tokens, rounds, t = tokens + step, rounds + 1, t + step
    return tokens, rounds


def acceptance_tables(rank: Tensor, valid: Tensor, loss_mask: Tensor, topk: tuple[int, ...] = TOPK,
                      confidence: Tensor | None = None) -> dict[str, Any]:
    """Tables from ranks (D, B, T), their validity (D, B, T) and the answers' loss mask (B, T). With `confidence`
    (D, B, T), the draft's top-1 probability, also its mean where the chain reaches depth d, beside
    `chain_conditional`: a calibrated drafter has the two equal (EAGLE-2's dynamic tree trusts these probabilities)."""
    v0 = valid[0]
    if not v0.any():
        raise ValueError("no position has a depth-1 target: the answers are empty.")
    hit = (rank == 0) & valid  # (D, B, T)
    run = hit.long().cumprod(dim=0)  # (D, B, T): depths 1..d+1 all right
    cond = [float(run[0][v0].float().mean())]
    reach = [v0] + [run[d - 1].bool() & valid[d] for d in range(1, rank.shape[0])]  # the chain got to depth d+1
    cond += [float(run[d][reach[d]].sum() / reach[d].sum().clamp(min=1)) for d in range(1, rank.shape[0])]
    lead = run.sum(0)  # (B, T)
    tokens = rounds = 0
    for b in range(rank.shape[1]):
        answer = loss_mask[b].nonzero().flatten()
        if answer.numel():
            n_tok, n_rounds = chain_rounds(lead[b], int(answer[0]) - 1, int(answer[-1]))
            tokens, rounds = tokens + n_tok, rounds + n_rounds
    extra = {}
    if confidence is not None:
        extra["chain_confidence"] = [float(confidence[d][r].float().mean()) if r.any() else float("nan")
                                     for d, r in enumerate(reach)]
    return extra | {
        "depth1_topk": {k: float(((rank[0] < k) & v0).sum() / v0.sum()) for k in topk},
        "chain_conditional": cond,
        "tau_positions": float(1 + lead[v0].float().mean()),
        "tau_rounds": tokens / max(rounds, 1),
        "positions": int(v0.sum()),
    }

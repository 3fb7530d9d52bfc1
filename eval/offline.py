"""Teacher-forced acceptance tables: what a drafter would get, measured without running the decode loop.

Every drafter is scored from ranks: rank[d, b, t] is where M_q's token x_{t+d+2} sits in the drafter's depth-(d+1)
distribution at position t (0 = its top-1), given the true tokens before it -- Medusa head d+1 on feature F_t, or
EAGLE's unrolled step d. From them:

- depth-1 top-k coverage: how often x_{t+2} is among the k best at depth 1, what a tree `k` wide at depth 1 catches;
- chain conditional accuracy: P(depth d right | depths < d right) for a chain of top-1 drafts;
- tau of that chain, averaged over positions (what training's `val/estimated_tau` reports) and over simulated decode
  rounds, each round starting where the previous accepted run ended (what `python -m eval tree=chain` measures;
  easy stretches are crossed in fewer rounds, so it is lower when acceptance comes in runs);
- per-position acceptance over those simulated rounds (`round_accept_per_position`), what a live chain decode
  reports as `accept_rate_per_position`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from data.datamodule import collate
from data.hidden_cache import gather_layers
from models.families import FAMILIES, family, resolve
from models.verifiers.core import Verifier
from runtime.errors import UserError

TOPK = (1, 2, 4, 8, 16)


def round_leads(lead: Tensor, first: int, last: int) -> list[int]:
    """Simulate chain decoding over one answer: the drafts each round gets accepted, in order. lead[t]: drafts a
    chain rooted after position t would get accepted; the first round's features end at `first` (the last prompt
    position; the prefill already gave x_{first+1}); `last` is the answer's final position. A round at t emits
    x_{t+2}.. (its accepted drafts and M_q's own token), so the next round starts after them: rounds start where the
    drafter last failed, which is why their acceptance differs from the average over positions."""
    leads = []
    t = first
    while t + 1 < last:
        leads.append(int(lead[t]))  # lead only counts targets inside the answer
        t += leads[-1] + 1
    return leads


def chain_rounds(lead: Tensor, first: int, last: int) -> tuple[int, int]:
    """(tokens emitted, rounds) of round_leads' simulated chain decode; their ratio is tau as
    `eval.engine.decode.DecodeResult.tau` counts it."""
    leads = round_leads(lead, first, last)
    return sum(leads) + len(leads), len(leads)


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
    leads: list[int] = []
    for b in range(rank.shape[1]):
        answer = loss_mask[b].nonzero().flatten()
        if answer.numel():
            leads += round_leads(lead[b], int(answer[0]) - 1, int(answer[-1]))
    tokens, rounds = sum(leads) + len(leads), len(leads)
    per_round = torch.tensor(leads or [0])
    extra = {}
    if confidence is not None:
        extra["chain_confidence"] = [float(confidence[d][r].float().mean()) if r.any() else float("nan")
                                     for d, r in enumerate(reach)]
    return extra | {
        "depth1_topk": {k: float(((rank[0] < k) & v0).sum() / v0.sum()) for k in topk},
        "chain_conditional": cond,
        "tau_positions": float(1 + lead[v0].float().mean()),
        "tau_rounds": tokens / max(rounds, 1),
        # alpha_k over the simulated rounds (the fraction whose k-th draft is accepted): what a live chain decode's
        # accept_rate_per_position reports (eval.engine.acceptance.per_position_acceptance), teacher-forced
        "round_accept_per_position": [float((per_round >= k).float().mean()) for k in range(1, rank.shape[0] + 1)],
        "positions": int(v0.sum()),
    }


# -- ranks of the verifier's tokens under each drafter (teacher-forced), the input of acceptance_tables -------------
# Each family's own function computes them (its registry entry's `teacher_forced`: eval.drafters.medusa.medusa_ranks,
# eval.drafters.eagle.eagle_ranks), with these two helpers.

def score_export(kind: str, net: Any, verifier: Verifier, rows: list[dict[str, Any]], depth: int,
                 bf16: bool = False, batch_size: int = 8, keep: Tensor | None = None) -> dict[str, Any]:
    """acceptance_tables for one drafter (Medusa heads or an EAGLE net; `kind` names its family) over tokenised answers
    `rows` (input_ids + loss_mask, e.g. the verifier's own answers to held-out prompts), teacher-forced `depth` deep.
    `bf16`: under bf16 autocast, as training's bf16-mixed runs it. `keep`: the tokens the drafter drafts over
    (an export's `train_ids`; EAGLE-1 and shared-head Medusa), None for all. The ranks come from the family's own
    function (its registry entry's `teacher_forced`)."""
    fam = family(kind, "kind")
    if fam.teacher_forced is None:
        raise UserError(f"{fam.title} has no export network to score teacher-forced; score an export of "
                        f"{', '.join(n for n, f in FAMILIES.items() if f.teacher_forced)}.")
    ranks_of = resolve(fam.teacher_forced)
    ranks, valids, confs, masks = [], [], [], []
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i : i + batch_size], verifier.tokenizer.pad_token_id or 0)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            r, v, c = ranks_of(net, verifier, batch, depth, keep)
        ranks += list(r.unbind(1))
        valids += list(v.unbind(1))
        confs += list(c.unbind(1))
        masks += list(batch["loss_mask"].unbind(0))
    width = max(m.shape[0] for m in masks)

    def fit(xs: list[Tensor], fill: Any) -> Tensor:
        return torch.stack([torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=fill) for x in xs], dim=-2)

    return acceptance_tables(fit(ranks, verifier.vocab_size), fit(valids, False), fit(masks, 0),
                             confidence=fit(confs, 0.0))


@torch.no_grad()
def verifier_top1(verifier: Verifier, rows: list[dict[str, Any]], batch_size: int = 8) -> float:
    """The verifier's mean top-1 probability (T = 1) at the positions that predict its own answer tokens (the
    next token is an assistant token): how sure M_q is of its greedy choice there. A ceiling indicator for greedy
    drafting: where M_q itself spreads its mass, its argmax is hard for any drafter to predict."""
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i : i + batch_size], verifier.tokenizer.pad_token_id or 0)
        hidden = gather_layers(batch, [-1], verifier, [-1])[-1][:, :-1]  # (B, T-1, D): predicts tokens 1..T-1
        predicts_answer = batch["loss_mask"][:, 1:].bool()
        top1 = verifier.lm_head(hidden[predicts_answer]).float().softmax(-1).amax(-1)
        total += float(top1.sum())
        count += top1.numel()
    if not count:
        raise ValueError("verifier_top1 needs rows with at least one assistant token (loss_mask).")
    return total / count


def first_answer_tokens(row: dict[str, Any], n: int | None) -> dict[str, Any]:
    """`row` (input_ids + loss_mask) cut after its first `n` assistant tokens (None: whole), so answers of any
    length are scored over the same window as a decode of n new tokens (the eval protocol's 128)."""
    answer = [i for i, m in enumerate(row["loss_mask"]) if m]
    if n is None or len(answer) <= n:
        return row
    end = answer[n - 1] + 1
    return {**row, "input_ids": row["input_ids"][:end], "loss_mask": row["loss_mask"][:end]}

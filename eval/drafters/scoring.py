"""Teacher-forced scoring helpers every family's `teacher_forced` function shares (the registry names it;
eval/offline.py calls it): the rank of each target under the draft, and a draft limited to the tokens it was trained
over."""

from __future__ import annotations

import torch
from torch import Tensor


def rank_rows(logits: Tensor, targets: Tensor, valid: Tensor, vocab: int, rank_of) -> tuple[Tensor, Tensor]:
    """(B, T) ranks of `targets` where `valid` (vocab elsewhere), and the draft's top-1 probability there."""
    rank = torch.full(valid.shape, vocab, dtype=torch.long)
    rank[valid] = rank_of(logits, targets)
    conf = torch.zeros(valid.shape)
    conf[valid] = logits.softmax(-1).amax(-1)
    return rank, conf


def keep_only(logits: Tensor, keep: Tensor | None) -> Tensor:
    """Logits over the full vocabulary with every token outside `keep` impossible (None: unchanged): what a drafter
    trained with train_vocab drafts over, so a target outside them ranks V (a miss)."""
    if keep is None:
        return logits
    outside = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device).index_fill(0, keep, False)
    return logits.masked_fill(outside, float("-inf"))

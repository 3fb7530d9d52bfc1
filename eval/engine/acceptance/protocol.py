"""What every acceptance rule is and gives: one round's outcome (`Acceptance`), the rule's protocol
(`AcceptanceRule`), the sampled rules' shared step (`SampledRule`: the verifier's logits warped by the run's sampling
settings, then the rule's own walk), and what the rounds add up to (tau, alpha_k).

Acceptance rules and their statistics, as small pure functions on tensors.
tau = tokens emitted per verifier forward, counting the bonus token; alpha_k = fraction of rounds whose k-th draft
token was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from eval.engine.sampling import SamplingConfig, warp

if TYPE_CHECKING:
    from eval.engine.protocol import Draft


@dataclass(frozen=True)
class Acceptance:
    """Outcome of one round, per batch row.

    path: (B,) row of `retrieve` that was accepted.
    num_accepted: (B,) draft tokens accepted on it, root excluded (0..depth).
    last_node: (B,) tree node of the last accepted token (the root when nothing was accepted).
    next_token: (B,) the verifier's own token after the last accepted one: the bonus token.
    """

    path: Tensor
    num_accepted: Tensor
    last_node: Tensor
    next_token: Tensor


@runtime_checkable
class AcceptanceRule(Protocol):
    """name: report.json's `sampling.rule`; exact: the output follows the (warped) verifier distribution (greedy:
    equals plain greedy decoding token for token); chains_only: defined on chains, a drafter proposing trees is
    refused before decoding."""

    name: str
    exact: bool
    chains_only: bool

    def accept(self, retrieve: Tensor, draft: Draft, logits: Tensor,
               generator: torch.Generator | None) -> Acceptance:
        """retrieve: (L, D+1) the tree's root-to-leaf node rows (eval.engine.tree.tree_buffers); logits: (B, N, V)
        the verifier's at every node; draft: the proposed tokens, tree and (sampled drafts) their probabilities."""
        ...


@dataclass(frozen=True)
class SampledRule:
    """A sampled acceptance rule (eval.engine.acceptance.protocol.AcceptanceRule): the verifier's logits warped by the
    run's sampling settings into q, then the rule's own walk over the draft (`on_q`)."""

    sampling: SamplingConfig
    name: ClassVar[str]
    exact: ClassVar[bool] = True
    chains_only: ClassVar[bool] = False

    def accept(self, retrieve: Tensor, draft: Draft, logits: Tensor,
               generator: torch.Generator | None) -> Acceptance:
        q = warp(logits, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
        return self.on_q(retrieve, draft, q, generator)

    def on_q(self, retrieve: Tensor, draft: Draft, q: Tensor, generator: torch.Generator | None) -> Acceptance:
        raise NotImplementedError


def mean_accept_length(accept_lengths: Tensor) -> float:
    """tau: tokens emitted per verifier forward over the rounds, counting the bonus token.

    accept_lengths: (R, B) draft tokens accepted in each round (bonus excluded). Returns 0.0 with no rounds.
    """
    if accept_lengths.numel() == 0:
        return 0.0
    return float((accept_lengths + 1).float().mean())


def per_position_acceptance(accept_lengths: Tensor, depth: int) -> Tensor:
    """alpha_k for k = 1..depth: the fraction of rounds whose k-th draft token was accepted. (R, B) -> (depth,)"""
    if accept_lengths.numel() == 0:
        return torch.zeros(depth)
    k = torch.arange(1, depth + 1, device=accept_lengths.device)
    return (accept_lengths.flatten()[:, None] >= k).float().mean(dim=0).cpu()

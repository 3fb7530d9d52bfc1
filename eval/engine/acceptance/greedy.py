"""Greedy acceptance (temperature 0): the longest drafted path that matches the verifier's argmax, so the output is
plain greedy decoding's, token for token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from eval.engine.acceptance.protocol import Acceptance

if TYPE_CHECKING:
    from eval.engine.protocol import Draft


def greedy_accept(retrieve: Tensor, draft_tokens: Tensor, q_logits: Tensor) -> Acceptance:
    """Greedy verification (temperature 0): accept the longest root-to-leaf prefix whose draft tokens equal the
    verifier M_q's argmax at their parent, then emit M_q's argmax at the last accepted node (the bonus token).

    The emitted tokens are exactly those plain greedy decoding with M_q would produce, whatever the drafter.
    A draft after the first wrong one on its path is never accepted, even when it matches. Ties: within one node's
    logits, the lowest token id wins (torch.argmax, as in eval.engine.decode.greedy_decode); between paths that accept
    equally many drafts, the first row of `retrieve` wins (tree_buffers orders rows depth-first by rank, so the
    lower-rank path). Padding (-1) in `retrieve` never matches.

    retrieve: (L, D+1) root-to-leaf node indices, right-padded with -1 (see eval.engine.tree.tree_buffers).
    draft_tokens: (B, N) token of every node; node 0 is the root, already emitted.
    q_logits: (B, N, V) verifier logits at every node, predicting the token after it.
    """
    argmax = q_logits.argmax(dim=-1)  # (B, N)
    valid = retrieve >= 0  # (L, P)
    nodes = retrieve.clamp(min=0)
    path_tokens = draft_tokens[:, nodes]  # (B, L, P)
    path_argmax = argmax[:, nodes]  # (B, L, P)
    # Draft at depth d is right when it equals the verifier's choice at depth d-1 on the same path.
    match = (path_tokens[:, :, 1:] == path_argmax[:, :, :-1]) & valid[None, :, 1:]  # (B, L, P-1)
    lengths = match.long().cumprod(dim=-1).sum(dim=-1)  # (B, L) accepted prefix length per path
    num_accepted, path = lengths.max(dim=-1)  # first maximum: ties go to the lower-rank path
    last_node = retrieve[path, num_accepted]  # (B,)
    next_token = argmax.gather(1, last_node[:, None])[:, 0]  # (B,)
    return Acceptance(path=path, num_accepted=num_accepted, last_node=last_node, next_token=next_token)


@dataclass(frozen=True)
class Greedy:
    """The longest path matching the verifier's argmax (eval.engine.acceptance.greedy.greedy_accept): the output is
    plain greedy decoding's, token for token."""

    name: str = "greedy"
    exact: bool = True
    chains_only: bool = False

    def accept(self, retrieve: Tensor, draft: Draft, logits: Tensor,
               generator: torch.Generator | None) -> Acceptance:
        return greedy_accept(retrieve, draft.tokens, logits)

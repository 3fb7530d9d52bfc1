"""Acceptance rules and their statistics, as small pure functions on tensors.

Notation (Leviathan et al., 2023; Chen et al., 2023): M_q is the verifier and q its probabilities; M_p is the
draft and p its probabilities. One verifier forward scores every node of a draft tree; a rule picks the accepted
root-to-leaf prefix and one more token from the verifier (the bonus token).
tau = tokens emitted per verifier forward, counting the bonus token; alpha_k = fraction of rounds whose k-th draft
token was accepted.

Only greedy acceptance (temperature 0) is built for now. Rules take the verifier's logits for every node, not only
its argmax, so that sampled acceptance with q and p can later take the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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

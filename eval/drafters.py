"""Drafters: one protocol, one factory. The decode loop never asks which drafter it holds.

Each round the loop hands a drafter M_p what the verifier M_q just produced: all tokens so far, whose last one is
the root of the next tree (chosen by the acceptance rule, not yet in M_q's cache), M_q's hidden states at the
positions it just committed (the prompt after prefill, the accepted path after a round), and M_q's logits at the
last of them. The drafter fills the tree's nodes with tokens and, where it has them, its probabilities p.
After verification it is told how many drafts were accepted, and on which nodes, so that a drafter with its own
KV cache (EAGLE, a draft model) can roll it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from eval.tree import Tree, tree_buffers
from models.errors import UserError
from models.medusa import MedusaHeads, load_medusa_export
from models.verifier import Verifier


@dataclass
class Draft:
    """One round's proposal.

    tree: the structure the tokens fill (a drafter may return a pruned or grown tree).
    tokens: (B, N) token per node; node 0 is the root.
    p: (B, N, V) or None; row i is the draft distribution node i was taken from (row 0, the root, is unused).
    """

    tree: Tree
    tokens: Tensor
    p: Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """What every drafter implements (Medusa, EAGLE, a draft model, prompt lookup, ...)."""

    def propose(self, input_ids: Tensor, hidden: Tensor, logits: Tensor, tree: Tree) -> Draft:
        """Fill `tree` for the next round.

        input_ids: (B, T) every token so far; input_ids[:, -1] is the root.
        hidden: (B, S, D) M_q's last-layer hidden states (lm_head inputs) at the S positions it just committed;
            hidden[:, -1] is at the token before the root. A drafter with a `feature_layers` attribute (indices
            into HF's `hidden_states`; None = the last layer) gets those layers concatenated instead, (B, S, K*D),
            from the same verifier forward (EAGLE-3 reads three).
        logits: (B, V) M_q's logits there, i.e. the distribution the root was chosen from.
        """
        ...

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Told after verification: `num_accepted` (B,) drafts were accepted, on tree nodes `nodes` (B, 1+A)
        counted from the root, in the draft just verified."""
        ...


class MedusaDrafter:
    """Medusa (Cai et al., 2024): head k (0-based) reads M_q's hidden state at the token before the root and
    predicts the token k+1 places after the root; its rank-r token fills every tree node at depth k+1 with rank r.

    Medusa drafts are independent per depth, so p for a node at depth d is head d-1's softmax, whatever its parent.
    """

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head: nn.Module | None = None,
        with_probs: bool = False,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.heads = heads.eval().requires_grad_(False)
        self.lm_head = lm_head
        self.with_probs = with_probs
        self.config = config or {}
        self._depth_rank: dict[Tree, tuple[Tensor, Tensor, int]] = {}

    @property
    def topk_accuracy(self) -> list[list[float]] | None:
        """Per-head cumulative top-1..top-R accuracy recorded at export (the input of eval.tree.auto_tree)."""
        return self.config.get("medusa_topk_accuracy")

    def _layout(self, tree: Tree, device: torch.device) -> tuple[Tensor, Tensor, int]:
        if tree not in self._depth_rank:
            if tree.max_depth > self.heads.num_heads:
                raise UserError(
                    f"The tree is {tree.max_depth} drafts deep but the Medusa export has {self.heads.num_heads} heads; "
                    f"use a tree of depth <= {self.heads.num_heads} (chain({self.heads.num_heads}) or fewer choices)."
                )
            depth = tree_buffers(tree).positions[1:].to(device)
            rank = torch.tensor(tree.ranks[1:], dtype=torch.long, device=device)
            topk = max(tree.ranks[1:], default=-1) + 1
            self._depth_rank[tree] = (depth, rank, topk)
        return self._depth_rank[tree]

    @torch.no_grad()
    def propose(self, input_ids: Tensor, hidden: Tensor, logits: Tensor, tree: Tree) -> Draft:
        root = input_ids[:, -1:]  # (B, 1)
        if tree.num_drafts == 0:
            return Draft(tree=tree, tokens=root)
        depth, rank, topk = self._layout(tree, input_ids.device)
        param = next(self.heads.parameters(), None)  # heads may train in fp32 next to a bf16 verifier
        h = hidden[:, -1] if param is None else hidden[:, -1].to(param.dtype)  # (B, D)
        if self.heads.share_lm_head:
            # One projection over all heads' features: a single (K, D) x (D, V) matmul costs less than half of K
            # separate matvecs through the 49k-vocabulary head on a CPU.
            feats = torch.stack([self.heads.head_features(h, k) for k in range(tree.max_depth)], dim=1)  # (B, K, D)
            head_logits = self.lm_head(feats.to(self.lm_head.weight.dtype))  # (B, K, V)
        else:
            head_logits = torch.stack(
                [self.heads.head_logits(h, k, self.lm_head) for k in range(tree.max_depth)], dim=1
            )  # (B, K, V)
        top = head_logits.topk(topk, dim=-1).indices  # (B, K, R)
        drafts = top[:, depth - 1, rank]  # (B, N-1): node i takes rank[i] of head depth[i]-1
        tokens = torch.cat([root, drafts.to(root.dtype)], dim=1)  # (B, N)
        p = None
        if self.with_probs:
            probs = head_logits.float().softmax(dim=-1)  # (B, K, V)
            p = torch.cat([torch.zeros_like(probs[:, :1]), probs[:, depth - 1]], dim=1)  # (B, N, V)
        return Draft(tree=tree, tokens=tokens, p=p)

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        pass  # Medusa heads keep no state between rounds


def _make_medusa(
    verifier: Verifier,
    checkpoint: str | Path | None = None,
    heads: MedusaHeads | None = None,
    with_probs: bool = False,
) -> MedusaDrafter:
    if (checkpoint is None) == (heads is None):
        raise UserError(
            "make_drafter('medusa', ...) needs exactly one of checkpoint=<export dir> or heads=<MedusaHeads>."
        )
    config: dict[str, Any] = {}
    if checkpoint is not None:
        heads, _, config = load_medusa_export(checkpoint, verifier)
    # A shared head is the verifier's own lm_head: the export's copy is the same weights (fingerprint-checked).
    lm_head = verifier.lm_head if heads.share_lm_head else None
    heads.to(verifier.device)
    return MedusaDrafter(heads, lm_head=lm_head, with_probs=with_probs, config=config)


def _make_eagle(verifier: Verifier, **kwargs: Any) -> Drafter:
    from eval.eagle import make_eagle  # eval.eagle imports this module for Draft

    return make_eagle("eagle", verifier, **kwargs)


def _make_eagle3(verifier: Verifier, **kwargs: Any) -> Drafter:
    from eval.eagle import make_eagle

    return make_eagle("eagle3", verifier, **kwargs)


DRAFTERS = {"medusa": _make_medusa, "eagle": _make_eagle, "eagle3": _make_eagle3}


def make_drafter(kind: str, verifier: Verifier, **kwargs: Any) -> Drafter:
    """Build a drafter by name for `verifier`; kwargs go to that drafter's builder
    (medusa: checkpoint=<export dir> or heads=<MedusaHeads>, with_probs=False;
    eagle / eagle3: checkpoint=<export dir> or net=<EagleDrafterNet>, topk, depth, total_tokens, with_probs;
    see eval.eagle.make_eagle)."""
    if kind not in DRAFTERS:
        raise UserError(f"drafter={kind!r} is not known; choose one of {sorted(DRAFTERS)}.")
    return DRAFTERS[kind](verifier, **kwargs)

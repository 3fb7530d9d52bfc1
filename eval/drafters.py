"""Drafters: one protocol, one factory. The decode loop never asks which drafter it holds.

Each round the loop hands a drafter M_p what the verifier M_q just produced: all tokens so far, whose last one is
the root of the next tree (chosen by the acceptance rule, not yet in M_q's cache), and M_q's hidden states at the
positions it just committed (the prompt after prefill, the accepted path after a round), of the layers the drafter
declared in `feature_layers`. The drafter owns the shape of what it proposes (its tree policy, eval.tree) and fills
that tree with tokens. After verification it is told how many drafts were accepted, and on which nodes, so that a
drafter with its own KV cache (EAGLE, a draft model) can roll it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from eval.sampling import SamplingConfig, warp
from eval.tree import AutoTree, Chain, DynamicTree, Tree, TreePolicy, auto_tree, chain, describe, tree_buffers
from models.eagle import EAGLE_NETS, NAMES
from models.errors import UserError
from models.export import frequent_ids, load_export
from models.medusa import MedusaHeads
from models.packed import Linear, can_pack
from models.verifier import Verifier


@dataclass
class Draft:
    """One round's proposal: the tree it fills (fixed, or grown this round) and a token per node, (B, N);
    node 0 is the root. p: (B, N, V) the warped distribution each node's token was drawn from (row 0 unused), when
    the drafter sampled its proposals; None for deterministic (top-k) drafts, which the sampling rule treats as
    one-hot p (eval.sampling)."""

    tree: Tree
    tokens: Tensor
    p: Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """What every drafter implements (Medusa, EAGLE, a draft model, prompt lookup, ...).

    feature_layers: the M_q hidden states it reads, as indices into HF's `hidden_states` (-1: the final-normed last
        layer, the lm_head input); the loop hands them concatenated on the last dimension, from the same forward.
    max_nodes / max_depth: the most nodes (root included) and levels a round's tree can have; the loop sizes the
        verifier's cache and the acceptance statistics on them.
    """

    feature_layers: tuple[int, ...]
    max_nodes: int
    max_depth: int

    def describe(self) -> dict[str, Any]:
        """The tree policy as report.json records it (what was really drafted)."""
        ...

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        """Fill this round's tree.

        input_ids: (B, T) every token so far; input_ids[:, -1] is the root.
        hidden: (B, S, len(feature_layers) * D) M_q's hidden states at the S positions it just committed;
            hidden[:, -1] is at the token before the root.
        """
        ...

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Told after verification: `num_accepted` (B,) drafts were accepted, on tree nodes `nodes` (B, 1+A)
        counted from the root, in the draft just verified."""
        ...


class MedusaDrafter:
    """Medusa (Cai et al., 2024): head k (0-based) reads M_q's hidden state at the token before the root and
    predicts the token k+1 places after the root; its rank-r token fills every tree node at depth k+1 with rank r.
    The tree is fixed: the same shape every round.

    sampling: with a SamplingConfig of temperature > 0, proposals are sampled instead of top-k: every node at depth
    d is an independent draw from head d-1's warped softmax, which `Draft.p` carries (eval.sampling's tree rule is
    exact for such i.i.d. siblings)."""

    feature_layers = (-1,)

    def __init__(self, heads: MedusaHeads, tree: Tree, lm_head: nn.Module | None = None, policy: str = "tree",
                 sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                 head_ids: Tensor | None = None) -> None:
        if tree.max_depth > heads.num_heads:
            raise UserError(
                f"The tree is {tree.max_depth} drafts deep but the Medusa export has {heads.num_heads} heads; "
                f"use a tree of depth <= {heads.num_heads} (tree=chain, or fewer medusa_choices)."
            )
        if max(tree.ranks[1:], default=0) >= heads.vocab_size:
            raise UserError(f"The tree asks for rank {max(tree.ranks)} of a head, but the vocabulary has "
                            f"{heads.vocab_size} tokens; use ranks below {heads.vocab_size} in medusa_choices.")
        self.heads = heads.eval().requires_grad_(False)
        self.tree, self.lm_head, self.policy = tree, lm_head, policy
        # `head_ids` (sorted verifier ids): `lm_head` is the shared head cut to those rows (row_head), and
        # draft ids index head_ids.
        self.head_ids = head_ids
        if head_ids is not None and max(tree.ranks[1:], default=0) >= head_ids.numel():
            raise UserError(f"The tree asks for rank {max(tree.ranks)} of a head, but drafter.draft_vocab keeps "
                            f"{head_ids.numel()} tokens; use a larger draft_vocab.")
        self.max_nodes, self.max_depth = tree.num_nodes, tree.max_depth
        device = next(heads.parameters(), torch.empty(0)).device
        self._depth = tree_buffers(tree).positions[1:].to(device)  # (N-1,) depth of each draft node
        self._rank = torch.tensor(tree.ranks[1:], dtype=torch.long, device=device)  # (N-1,)
        self._topk = max(tree.ranks[1:], default=-1) + 1
        self.vocab_size = heads.vocab_size
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.generator = generator

    def describe(self) -> dict[str, Any]:
        return {"policy": self.policy, "proposals": "sampled" if self.sampling else "topk", **describe(self.tree)}

    @torch.no_grad()
    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        root = input_ids[:, -1:]  # (B, 1)
        if self.tree.num_drafts == 0:
            return Draft(tree=self.tree, tokens=root)
        param = next(self.heads.parameters(), None)  # heads may train in fp32 next to a bf16 verifier
        h = hidden[:, -1] if param is None else hidden[:, -1].to(param.dtype)  # (B, D)
        depth = self.tree.max_depth
        if self.heads.share_lm_head:
            # One projection over all heads' features: a single (K, D) x (D, V) matmul costs less than half of K
            # separate matvecs through the 49k-vocabulary head on a CPU.
            feats = torch.stack([self.heads.head_features(h, k) for k in range(depth)], dim=1)  # (B, K, D)
            head_logits = self.lm_head(feats.to(self.lm_head.weight.dtype))  # (B, K, V)
        else:
            head_logits = torch.stack([self.heads.head_logits(h, k) for k in range(depth)], dim=1)  # (B, K, V)
        if self.sampling is not None:
            return self._sample(root, head_logits)
        top = head_logits.topk(self._topk, dim=-1).indices  # (B, K, R)
        drafts = top[:, self._depth - 1, self._rank]  # (B, N-1): node i takes rank[i] of head depth[i]-1
        if self.head_ids is not None:
            drafts = self.head_ids[drafts]
        return Draft(tree=self.tree, tokens=torch.cat([root, drafts.to(root.dtype)], dim=1))  # (B, N)

    def _sample(self, root: Tensor, head_logits: Tensor) -> Draft:
        """Each draft node an independent draw from its head's warped distribution. (B, K, V) -> Draft with p."""
        s = self.sampling
        if self.head_ids is not None:  # back to the verifier's vocabulary, every other token impossible
            full = head_logits.new_full((*head_logits.shape[:-1], self.vocab_size), float("-inf"))
            head_logits = full.index_copy_(-1, self.head_ids, head_logits)
        probs = warp(head_logits, s.temperature, s.top_p, s.top_k)  # (B, K, V)
        bsz, depth = root.shape[0], self._depth - 1  # (N-1,) head of each node
        drafts = torch.empty(bsz, depth.numel(), dtype=root.dtype, device=root.device)
        for k in range(self.tree.max_depth):
            at = (depth == k).nonzero()[:, 0]  # the nodes head k fills
            drafts[:, at] = torch.multinomial(probs[:, k], at.numel(), replacement=True, generator=self.generator)
        p = torch.cat([torch.zeros_like(probs[:, :1]), probs[:, depth]], dim=1)  # (B, N, V), row 0 unused
        return Draft(tree=self.tree, tokens=torch.cat([root, drafts], dim=1), p=p)

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        pass  # Medusa heads keep no state between rounds


class _Rows:
    """A bias-free head over given weight rows, where they cannot be prepacked (fp32, or no mkldnn)."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight

    def __call__(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight)


def row_head(verifier: Verifier, ids: Tensor) -> Linear | _Rows:
    """The verifier's lm_head cut to the rows `ids` (prepacked where `can_pack` holds): logits over those tokens only,
    reading |ids| x D weights instead of V x D."""
    rows = verifier.lm_head.weight.detach()[ids]
    return Linear(rows, None, True) if can_pack(rows) else _Rows(rows)


def medusa_tree(policy: TreePolicy, heads: MedusaHeads, topk_accuracy: list[list[float]] | None) -> tuple[Tree, str]:
    """The fixed tree a Medusa drafter proposes under `policy`, and the policy's name."""
    if isinstance(policy, Tree):
        return policy, "tree"
    if isinstance(policy, Chain):
        return chain(heads.num_heads if policy.depth is None else policy.depth), "chain"
    if isinstance(policy, AutoTree):
        if not topk_accuracy:
            raise UserError("tree=auto needs the per-head top-k accuracies the export records "
                            "(medusa_topk_accuracy), and this export has none. Use tree=chain or "
                            "tree=medusa_choices, or re-export.")
        return auto_tree(topk_accuracy[: heads.num_heads], policy.size), "auto"
    raise UserError(f"tree={type(policy).__name__} does not fit a Medusa drafter, whose tree is the same every round; "
                    f"use tree=chain, tree=auto or tree=medusa_choices.")


def make_drafter(kind: str | None, verifier: Verifier, tree: TreePolicy, checkpoint: str | Path | None = None,
                 net: nn.Module | None = None, sampling: SamplingConfig | None = None,
                 generator: torch.Generator | None = None, draft_vocab: int | None = None) -> Drafter:
    """A drafter for `verifier` proposing trees under the policy `tree`, from an export (checkpoint=<dir>; `kind`
    None takes the export's own) or a network (net=<MedusaHeads or EAGLE net>, `kind` naming it). With `sampling`
    (temperature > 0) it samples its proposals from its warped distribution instead of taking the top-k.
    `draft_vocab` (EAGLE-1, shared-head Medusa): draft over the export's `draft_vocab` most frequent training targets
    only, through those rows of the verifier's lm_head. None: the export's `train_vocab` (a drafter trained over that
    many rows: train/base.py), else the full vocabulary."""
    if (checkpoint is None) == (net is None):
        raise UserError(f"make_drafter({kind!r}, ...) needs exactly one of checkpoint=<export dir> or net=<network>.")
    if kind is not None and kind not in DRAFTER_KINDS:
        raise UserError(f"drafter={kind!r} is not known; choose one of {sorted(DRAFTER_KINDS)}.")
    config: dict[str, Any] = {}
    counts = None
    if checkpoint is not None:
        export = load_export(checkpoint, verifier, kind)
        kind, net, config, counts = export.kind, export.net, export.config, export.target_counts
    elif kind is None or not isinstance(net, MedusaHeads if kind == "medusa" else EAGLE_NETS[kind]):
        found = "medusa" if isinstance(net, MedusaHeads) else getattr(net, "kind", type(net).__name__)
        raise UserError(f"net is a {NAMES.get(found, found)} drafter but was given as {NAMES.get(kind, kind)}; use "
                        f"make_drafter({found!r}, ...).")
    net = net.to(verifier.device)
    if draft_vocab is None and config.get("train_vocab"):
        draft_vocab = config["train_vocab"]  # trained over those rows: draft over them
    head_ids = None
    if draft_vocab is not None:
        if kind == "eagle3" or (kind == "medusa" and not net.share_lm_head):
            raise UserError(f"drafter.draft_vocab={draft_vocab} cuts the verifier's lm_head that EAGLE-1 and "
                            f"shared-head Medusa draft through; this {NAMES.get(kind, kind)} drafter has its own head. "
                            f"Leave drafter.draft_vocab=null.")
        if counts is None:
            raise UserError(f"drafter.draft_vocab={draft_vocab} needs the export's training-target counts "
                            f"(target_counts.safetensors), and {checkpoint} has none. Re-export it with a current "
                            f"train.py (python train.py <the run's overrides> ckpt_path=last validate_only=true), or "
                            f"leave drafter.draft_vocab=null.")
        head_ids = frequent_ids(counts, int(draft_vocab)).to(verifier.device)
    if kind == "medusa":
        shape, name = medusa_tree(tree, net, config.get("medusa_topk_accuracy"))
        # A shared head is the verifier's own lm_head: the export's copy is the same weights (fingerprint-checked).
        from eval.engine import packed_head  # prepacked in bf16 on CPU

        lm_head = None
        if net.share_lm_head:
            lm_head = packed_head(verifier.lm_head) if head_ids is None else row_head(verifier, head_ids)
        return MedusaDrafter(net, shape, lm_head=lm_head, policy=name,
                             sampling=sampling, generator=generator, head_ids=head_ids)
    from eval.eagle import EagleDrafter  # eval.eagle imports this module for Draft

    return EagleDrafter(net, verifier, tree, sampling=sampling, generator=generator, head_ids=head_ids)


DRAFTER_KINDS = ("medusa", *EAGLE_NETS)

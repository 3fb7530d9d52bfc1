"""Medusa heads at decode time (Cai et al., 2024): one fixed tree every round, filled from the heads' top-k (or
sampled) tokens. `medusa_drafter` builds one from a loaded export (models/families.py names it the family's
decoder)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from eval.drafters.heads import row_head, weights_dtype
from eval.engine.protocol import Draft
from eval.engine.sampling import SamplingConfig, warp
from eval.engine.tree import Tree, TreePolicy, describe, fixed_tree, tree_buffers
from models.eagle import target_rank
from models.medusa import MedusaHeads, medusa_targets
from models.verifiers.core import Verifier
from runtime.errors import UserError


class MedusaDrafter:
    """Medusa (Cai et al., 2024): head k (0-based) reads M_q's hidden state at the token before the root and
    predicts the token k+1 places after the root; its rank-r token fills every tree node at depth k+1 with rank r.
    The tree is fixed: the same shape every round.

    sampling: with a SamplingConfig of temperature > 0, proposals are sampled instead of top-k: every node at depth
    d is an independent draw from head d-1's warped softmax, which `Draft.p` carries (eval.engine.sampling's tree rule
    is exact for such i.i.d. siblings)."""

    feature_layers = (-1,)

    def __init__(self, heads: MedusaHeads, tree: Tree, lm_head: nn.Module | None = None, policy: str = "tree",
                 sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                 head_ids: Tensor | None = None) -> None:
        self.heads = heads.eval().requires_grad_(False)
        self.lm_head, self.policy = lm_head, policy
        # `head_ids` (sorted verifier ids): `lm_head` is the shared head cut to those rows (row_head), and
        # draft ids index head_ids.
        self.head_ids = head_ids
        self.vocab_size = heads.vocab_size
        self.depth_limit = heads.num_heads  # the deepest tree it can fill: one head a depth
        self.set_tree(tree)
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.generator = generator

    def set_tree(self, tree: Tree) -> None:
        """Draft `tree` from the next round on: the hook through which the adaptive planner (eval.planner.adaptive)
        re-plans a fixed tree between rounds. The heads run once a round whatever the tree; it only says which of their
        top-k tokens fill which node (and how many heads run: as many as it is deep)."""
        heads = self.heads
        if tree.max_depth > heads.num_heads:
            raise UserError(
                f"The tree is {tree.max_depth} drafts deep but the Medusa export has {heads.num_heads} heads; "
                f"use a tree of depth <= {heads.num_heads} (tree=chain, or fewer medusa_choices)."
            )
        if max(tree.ranks[1:], default=0) >= heads.vocab_size:
            raise UserError(f"The tree asks for rank {max(tree.ranks)} of a head, but the vocabulary has "
                            f"{heads.vocab_size} tokens; use ranks below {heads.vocab_size} in medusa_choices.")
        if self.head_ids is not None and max(tree.ranks[1:], default=0) >= self.head_ids.numel():
            raise UserError(f"The tree asks for rank {max(tree.ranks)} of a head, but drafter.draft_vocab keeps "
                            f"{self.head_ids.numel()} tokens; use a larger draft_vocab.")
        self.tree = tree
        self.max_nodes, self.max_depth = tree.num_nodes, tree.max_depth
        device = next(heads.parameters(), torch.empty(0)).device
        self._depth = tree_buffers(tree).positions[1:].to(device)  # (N-1,) depth of each draft node
        self._rank = torch.tensor(tree.ranks[1:], dtype=torch.long, device=device)  # (N-1,)
        self._topk = max(tree.ranks[1:], default=-1) + 1

    def describe(self) -> dict[str, Any]:
        return {"policy": self.policy, "proposals": "sampled" if self.sampling else "topk",
                "weights": weights_dtype(self.heads), **describe(self.tree)}

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

    def skipped(self, positions: int) -> None:
        """eval.engine.protocol.Skippable: nothing to catch up (the heads read the last position only)."""

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> list[float]:
        """eval.engine.protocol.CostProbe: one `propose`, the same ms for every size (the heads run once a round
        whatever the tree; the tree only indexes their top-k)."""
        from eval.engine.timing import prefix_cache, timed

        hidden = prefix_cache(verifier, prefix_ids, engine).forward(prefix_ids, layers=self.feature_layers).hidden
        seq = torch.cat([prefix_ids, prefix_ids[:, -1:]], dim=1)  # which root does not change the cost
        one = timed(lambda: self.propose(seq, hidden), reps)
        return [round(one, 3)] * len(sizes)


def medusa_drafter(net: MedusaHeads, config: dict[str, Any], verifier: Verifier, tree: TreePolicy,
                   sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                   head_ids: Tensor | None = None) -> MedusaDrafter:
    """The Medusa drafter for loaded heads under `policy` (its tree=auto from the export's medusa_topk_accuracy). A
    shared head is the verifier's own lm_head: the export's copy is the same weights (fingerprint-checked)."""
    from eval.engine.forward import packed_head  # prepacked in bf16 on CPU

    shape, name = fixed_tree(tree, net.num_heads, config.get("medusa_topk_accuracy"), "Medusa", "medusa_topk_accuracy")
    lm_head = None
    if net.share_lm_head:
        lm_head = packed_head(verifier.lm_head) if head_ids is None else row_head(verifier, head_ids)
    return MedusaDrafter(net, shape, lm_head=lm_head, policy=name, sampling=sampling, generator=generator,
                         head_ids=head_ids)


def medusa_ranks(heads: MedusaHeads, verifier: Verifier, batch: dict[str, Tensor], depth: int,
                 keep: Tensor | None = None) -> tuple[Tensor, ...]:
    """Teacher-forced scoring (eval.offline.score_export; the registry's `teacher_forced`): (D, B, T) ranks of
    x_{t+d+1} under head d, validity, and the head's top-1 probability; with `keep`, over those tokens only."""
    from data.hidden_cache import gather_layers
    from eval.drafters.scoring import keep_only, rank_rows

    hidden = gather_layers(batch, [-1], verifier, [-1])[-1]  # (B, T, D)
    vocab = verifier.vocab_size
    ranks, valids, confs = [], [], []
    for k, (targets, valid) in enumerate(medusa_targets(batch["input_ids"], batch["loss_mask"], heads.num_heads)):
        if k >= depth:
            break
        logits = keep_only(heads.head_logits(hidden[valid], k, verifier.lm_head).float(), keep)  # (N, V)
        rank, conf = rank_rows(logits, targets[valid], valid, vocab, target_rank)
        ranks.append(rank)
        valids.append(valid)
        confs.append(conf)
    return torch.stack(ranks), torch.stack(valids), torch.stack(confs)

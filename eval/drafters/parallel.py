"""Drafters that draft every depth in one forward (P-EAGLE, DFlash and the block drafters built on it): the shared part
of their rounds. Each round the drafter takes in the positions the verifier just committed (the verifier-fed drafter's
step-0 cache, eval/drafters/verifier_fed.py, or a family's own `_extend`), then one forward gives the distributions of
depths 1..K (`_depth_logits`, the family's own). No depth reads the drafts before it, so the tree is Medusa's kind,
fixed every round (`tree=auto` from the export's per-depth top-k table, a chain, or `medusa_choices`), and a node at
depth d with rank r takes depth d's rank-r token. Sampled drafts (`sampled_drafts=true`) are independent draws from
their depth's warped distribution, which `Draft.p` carries (eval.engine.sampling's tree rule is exact for such i.i.d.
siblings).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from eval.drafters.heads import weights_dtype
from eval.drafters.verifier_fed import VerifierFedDrafter
from eval.engine.protocol import Draft
from eval.engine.sampling import SamplingConfig, warp
from eval.engine.tree import Tree, TreePolicy, auto_tree, describe, fixed_tree, tree_buffers
from models.families import FAMILIES
from models.verifiers.core import Verifier
from runtime.errors import UserError


class ParallelDrafter(VerifierFedDrafter):
    """A drafter that drafts every depth in one forward (eval.engine.protocol.Drafter): the verifier-fed drafter's
    cache of the committed positions (`_extend`: step-0 keys by default, DFlash's context cache), then one forward's
    K distributions (`_depth_logits`, the family's own) fill a fixed tree of depth <= K. `title` names the family
    in messages."""

    title = "parallel"

    def __init__(self, net: Any, verifier: Verifier, tree: Tree, policy: str = "tree",
                 sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                 head_ids: Tensor | None = None, table: list[list[float]] | None = None) -> None:
        super().__init__(net, verifier, sampling=sampling, generator=generator, head_ids=head_ids)
        self.table = table[: net.parallel] if table else None  # per-depth top-k accuracy: the tree each budget buys
        self.tree_policy, self.depth_limit = policy, net.parallel  # the deepest tree one forward fills
        self.set_tree(tree)

    def set_tree(self, tree: Tree) -> None:
        """Draft `tree` from the next round on: the hook through which the adaptive planner (eval.planner.adaptive)
        re-plans a fixed tree between rounds (the forward runs as deep as the tree)."""
        if tree.max_depth > self.net.parallel:
            raise UserError(f"The tree is {tree.max_depth} drafts deep but the {self.title} export drafts "
                            f"{self.net.parallel} tokens per forward; use a tree of depth <= {self.net.parallel}.")
        if max(tree.ranks[1:], default=0) >= self.head_size:
            raise UserError(f"The tree asks for rank {max(tree.ranks)} of a depth, but the draft vocabulary has "
                            f"{self.head_size} tokens; use smaller ranks.")
        device = self.embed.weight.device
        self.tree = tree
        self.size, self.max_nodes, self.max_depth = tree.num_drafts, tree.num_nodes, tree.max_depth
        self._depth = tree_buffers(tree).positions[1:].to(device)  # (N-1,) depth of each draft node
        self._rank = torch.tensor(tree.ranks[1:], dtype=torch.long, device=device)
        self._topk = max(tree.ranks[1:], default=-1) + 1

    def describe(self) -> dict[str, Any]:
        return {"policy": self.tree_policy, "proposals": "sampled" if self.sampling else "topk",
                "weights": weights_dtype(self.net), "parallel_tokens": self.net.parallel, **describe(self.tree)}

    def _depth_logits(self, root_out: Any, depth: int | None = None) -> Tensor:
        """The drafter's logits for depths 1..depth (the tree's max_depth by default), from one forward. (depth, V)"""
        raise NotImplementedError

    def _start_round(self, input_ids: Tensor, hidden: Tensor) -> tuple[Any, Tensor]:
        """A round's start: one sequence; the newly committed positions into the cache. Returns what the cache
        update gives the family (EAGLE's line: the root's output) and the root token (1, 1)."""
        if input_ids.shape[0] != 1:
            raise UserError(f"{self.title} drafting runs one sequence at a time; got batch size {input_ids.shape[0]}.")
        return self._extend(input_ids, hidden), input_ids[:, -1:]

    @torch.no_grad()
    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        root_out, root = self._start_round(input_ids, hidden)
        if self.tree.num_drafts == 0:
            return Draft(tree=self.tree, tokens=root)
        logits = self._depth_logits(root_out)  # (K, Vd)
        if self.sampling is not None:
            probs = self._full_probs_of(logits)  # (K, V)
            depth = self._depth - 1
            drafts = torch.empty(depth.numel(), dtype=root.dtype, device=root.device)
            for k in range(self.max_depth):
                at = (depth == k).nonzero()[:, 0]
                drafts[at] = torch.multinomial(probs[k], at.numel(), replacement=True, generator=self.generator)
            p = torch.cat([torch.zeros_like(probs[:1]), probs[depth]])[None]  # (1, N, V), row 0 unused
            return Draft(tree=self.tree, tokens=torch.cat([root, drafts[None]], dim=1), p=p)
        top = logits.topk(self._topk, dim=-1).indices  # (K, R)
        drafts = self.to_verifier(top[self._depth - 1, self._rank])  # (N-1,)
        return Draft(tree=self.tree, tokens=torch.cat([root, drafts.to(root.dtype)[None]], dim=1))

    def _full_probs_of(self, logits: Tensor) -> Tensor:
        """Warped distributions over the verifier's vocabulary (the draft vocabulary mapped through d2t). (K, V)"""
        if logits.shape[-1] != self.vocab_size:
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.to_verifier(torch.arange(logits.shape[-1], device=logits.device)), logits)
        s = self.sampling
        return warp(logits, s.temperature, s.top_p, s.top_k)

    @torch.no_grad()
    def trial(self, input_ids: Tensor, hidden: Tensor, drafts: int) -> Tree | None:
        """One round's drafting as a drafter planned for `drafts` drafts does it (the new features, then one forward
        as deep as that tree), leaving the cache as it was: what eval.planner.cost.draft_curve times. With the
        export's table the tree is the one tree.size=auto would build for the budget (a one-deep tree needs
        no mask forward); without it, this drafter's own tree. Returns that tree."""
        tree = auto_tree(self.table, drafts) if self.table and drafts else self.tree
        keys = self._k, self._v
        try:
            root_out = self._extend(input_ids, hidden)
            if drafts and tree.num_drafts:
                self._depth_logits(root_out, tree.max_depth).topk(max(tree.ranks[1:]) + 1, dim=-1)
            return tree
        finally:
            self._k, self._v = keys


def family_tree(kind: str, depths: int, config: dict[str, Any], tree: TreePolicy
                ) -> tuple[Tree, str, list[list[float]] | None]:
    """A fixed-tree drafter's tree under `tree` for family `kind`, read from its registry entry (models/families.py):
    the export's per-depth top-k table (the first of the family's `acceptance` keys that holds one, which tree=auto
    plans on), the tree at most `depths` deep, the policy's name, and the table; the family's title in messages."""
    entry = FAMILIES[kind]
    table = next((config[k] for k in entry.acceptance
                  if config.get(k) and isinstance(config[k][0], (list, tuple))), None)
    shape, name = fixed_tree(tree, depths, table, entry.title, entry.acceptance[0])
    return shape, name, table

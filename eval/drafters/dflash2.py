"""DFlash2 at decode time (models/dflash2.py): one block forward, then depth by depth through the candidate selector.

Each round: 1. the new committed positions enter the context cache (DFlash's `_extend`); 2. one block forward over
[root, K masks] (the convolutions inside it) gives slot outputs h_1..h_K and their unary logits lm_head(h_k);
3. depth by depth, each node's children are the slot's unary top-`selector_top_k` candidates re-scored by the selector
given the node's token (the root's for depth 1): the node's rank-r child is the r-th best of those scores, or a
sample from their softmax (warped as the sampling options say); every other token has probability 0. So each draft
conditions on the one drafted before it, as vLLM's `DFlash2Speculator` walks the same scores. The tree is fixed, as
DFlash's (tree=auto plans on the export's per-depth table, measured on the re-scored draft). Greedy acceptance keeps
plain greedy's tokens whatever is proposed, and sampled acceptance reads the same p the draft was sampled from, so the
output is the verifier's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from eval.drafters.dflash import DFlashDrafter, block_ranks
from eval.drafters.parallel import family_tree
from eval.engine.protocol import Draft
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import Tree, TreePolicy
from models.dflash2 import DFlash2Net
from models.verifiers.core import Verifier
from runtime.errors import UserError


class DFlash2Drafter(DFlashDrafter):
    """DFlash2 for the drafter protocol: DFlash's context cache and block forward, the selector per depth."""

    net: DFlash2Net
    title = "DFlash2"

    def set_tree(self, tree: Tree) -> None:
        if max(tree.ranks[1:], default=0) >= self.net.selector_top_k:
            raise UserError(f"The tree asks for rank {max(tree.ranks)} of a depth, but the DFlash2 export re-scores "
                            f"its top {self.net.selector_top_k} candidates per depth (selector_top_k); use ranks "
                            f"below {self.net.selector_top_k}.")
        super().set_tree(tree)

    conditions_on_parent = True

    def _children(self, out: Tensor, unary: Tensor, prev: Tensor) -> Tensor:
        """The re-scored logits (m, V) of the children of parents with tokens `prev` (m,) at one depth: slot output
        `out` (1, D), its unary logits `unary` (V,)."""
        return self.net.rescored(unary[None], out, prev)

    def _child_logits(self, out: Tensor, base: Tensor, prev: Tensor, state: Any) -> tuple[Tensor, Any]:
        return self._children(out, base, prev), None

    def _draft_block(self, out: Tensor, tokens: Tensor, p: Tensor | None) -> Draft:
        tree, device = self.tree, tokens.device
        unary = self.net.logits(out, self.lm_head).float()  # (K, V)
        for d in range(1, tree.max_depth + 1):  # 3. depth by depth: each parent's children through the selector
            kids, parents, row = self._depth_nodes(d, device)
            self._draft_children(self._children(out[d - 1 : d], unary[d - 1], tokens[parents]), kids, row, tokens, p)
        return Draft(tree=tree, tokens=tokens[None], p=None if p is None else p[None])


def dflash2_drafter(net: DFlash2Net, config: dict[str, Any], verifier: Verifier, tree: TreePolicy,
                    sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                    head_ids: Tensor | None = None) -> DFlash2Drafter:
    """The DFlash2 drafter for a loaded network (models/families.py names it the family's decoder): a fixed tree
    under `tree` (tree=auto from the export's eagle_topk_accuracy), at most K = block_size - 1 deep."""
    if head_ids is not None:
        raise UserError("drafter.draft_vocab cuts the verifier's head, but DFlash2's selector codebooks span the "
                        "whole vocabulary; leave drafter.draft_vocab=null for a DFlash2 export.")
    shape, name, table = family_tree("dflash2", net.parallel, config, tree)
    return DFlash2Drafter(net, verifier, shape, policy=name, sampling=sampling, generator=generator, table=table)


def dflash2_ranks(net: DFlash2Net, verifier: Verifier, batch: dict[str, Tensor], depth: int,
                  keep: Tensor | None = None) -> tuple[Tensor, ...]:
    """Teacher-forced scoring (eval.offline.score_export; the registry's `teacher_forced`): DFlash's block ranks
    (eval.drafters.dflash.block_ranks), each slot re-scored given the previous target token."""
    if keep is not None:
        raise UserError("a kept vocabulary (train_vocab / draft_vocab) does not apply to DFlash2: its selector spans "
                        "the whole vocabulary.")
    return block_ranks(net, verifier, batch, depth,
                       lambda h, before: net.rescored(net.logits(h, verifier.lm_head).float(), h, before))

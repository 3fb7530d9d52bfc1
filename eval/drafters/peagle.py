"""P-EAGLE at decode time (models/peagle.py): one drafter forward drafts every depth.

Each round the drafter first extends its cache with the step-0 keys of the positions the verifier just committed,
as EAGLE does (eval/drafters/eagle.py `EagleDrafter._extend`; its output at the last one gives depth 1), then runs its
mask slots 1..K-1 in one forward (`PEagleNet.mask_slots`): depth d+1's distribution is slot d's. The rest of a round
(the fixed tree, top-k or sampled drafts, the planner's trial) is every parallel drafter's (eval/drafters/parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from eval.drafters.parallel import ParallelDrafter, family_tree
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import TreePolicy
from models.peagle import PEagleNet
from models.verifiers.core import Verifier
from runtime.errors import UserError


class PEagleDrafter(ParallelDrafter):
    """P-EAGLE for the drafter protocol: EAGLE's KV cache of committed step-0 keys (its output at the last one gives
    depth 1), then the mask slots 1..K-1 in one forward (`PEagleNet.mask_slots`): depth d+1's distribution is slot
    d's."""

    title = "P-EAGLE"

    def _depth_logits(self, root_out: Any, depth: int | None = None) -> Tensor:
        """The drafter's logits for depths 1..depth (the tree's max_depth by default): the root's output, then the
        mask slots'. (depth, Vd)"""
        depth = self.max_depth if depth is None else depth
        outs = [root_out[:, None]]
        if depth > 1:
            outs.append(self.net.mask_slots(depth - 1, self.cache_length, self._k, self._v, self.embed))
        return self.net.logits(torch.cat(outs, dim=1)).float()[0]


def peagle_drafter(net: PEagleNet, config: dict[str, Any], verifier: Verifier, tree: TreePolicy,
                   sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                   head_ids: Tensor | None = None) -> PEagleDrafter:
    """The P-EAGLE drafter for a loaded network (models/families.py names it the family's decoder): a fixed tree
    under `tree` (tree=auto from the export's eagle_topk_accuracy), at most K deep."""
    if head_ids is not None:
        raise UserError("drafter.draft_vocab cuts a drafting head shared with the verifier; P-EAGLE drafts over its "
                        "own trained draft vocabulary. Leave drafter.draft_vocab=null.")
    shape, name, table = family_tree("peagle", net.parallel, config, tree)
    return PEagleDrafter(net, verifier, shape, policy=name, sampling=sampling, generator=generator, table=table)

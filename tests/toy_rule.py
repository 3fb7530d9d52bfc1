"""A toy acceptance rule defined outside the package, to show that adding a rule is one module plus its registration
(eval.engine.acceptance): `verify=first_only` accepts at most the first draft, by rejection sampling on its own (the
chain cut to depth 1: exact, since rejection sampling is exact on any prefix of the tree), and samples the next
token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eval.engine.acceptance import register
from eval.engine.acceptance.protocol import Acceptance
from eval.engine.acceptance.sampled import sample_accept
from eval.engine.protocol import Draft
from eval.engine.sampling import SamplingConfig, warp


@dataclass(frozen=True)
class FirstOnly:
    sampling: SamplingConfig
    name: str = "first draft only (exact)"
    exact: bool = True
    chains_only: bool = True

    def accept(self, retrieve: Tensor, draft: Draft, logits: Tensor, generator: torch.Generator | None) -> Acceptance:
        n = min(2, draft.tokens.shape[1])  # the root and its first draft (a last round may hold the root alone)
        q = warp(logits[:, :n], self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
        p = None if draft.p is None else draft.p[:, :n]
        return sample_accept(retrieve[:, :n], draft.tree.parents[:n], draft.tokens[:, :n], q, p, generator)


register("first_only", FirstOnly)

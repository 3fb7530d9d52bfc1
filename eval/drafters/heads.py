"""Drafting heads over some rows of the verifier's lm_head: logits over those tokens only (FR-Spec, Zhao et al.
2025), prepacked where the machine allows it. Shared by the Medusa and EAGLE-1 drafters (`draft_vocab`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.packed import Linear, can_pack
from models.verifiers.core import Verifier


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


def weights_dtype(net: nn.Module) -> str | None:
    """The dtype a drafter's own weights run in (its `describe()["weights"]`, what the report records as
    `drafter_dtype`), or None for a network with no weights of its own (Medusa heads that are the verifier's head)."""
    param = next(net.parameters(), None)
    return None if param is None else str(param.dtype).removeprefix("torch.")

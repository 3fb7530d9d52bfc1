"""Prepacked bf16 linears for CPUs: the weight reordered once into oneDNN's blocked layout, every call through the
prepacked kernel (what inductor's freezing pass does). `F.linear` on a bf16 CPU tensor reorders the whole weight on
each call, so a step that reads each weight once pays for it twice.

Users: eval.engine (the verifier's decode path, and the vocabulary head drafters share) and data.generate (batched
self-distillation, through `packed_linears`). Same results as F.linear, bitwise, on the shapes tested
(tests/test_engine.py, tests/test_data_scale.py).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def can_pack(weight: Tensor) -> bool:
    """oneDNN's prepacked linear applies: a bf16 weight on a CPU build with mkldnn."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """y = x W^T + b. With `packed` (bf16 on CPU: `can_pack`), the weight is reordered once into oneDNN's blocked
    layout and every call runs the prepacked kernel (what inductor's freezing pass does); F.linear on a bf16 CPU
    tensor reorders the whole weight on each call, so a one-token step, which reads each weight once, paid for it
    twice (measured: a bf16 step of the default verifier 50.6 -> 39.9 ms on one thread, bitwise the same logits).
    Otherwise plain F.linear.

    `min_rows`: a call over fewer rows is padded to that many by repeating its last row, and only its own rows are
    returned. Kernels pick their path by row count (on an AMX CPU, oneDNN's bf16 kernels take another path up to 32
    rows than above), so a weight whose kernel is batch-invariant only from P rows up gets `min_rows = P`
    (`with_min_rows`; eval.engine probes P per shape)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, packed: bool, min_rows: int = 1) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = packed and can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight
        self.min_rows = min_rows

    def with_min_rows(self, min_rows: int) -> Linear:
        """The same weights (shared, not copied), padding every call to at least `min_rows` rows."""
        other = copy.copy(self)
        other.min_rows = min_rows
        return other

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if m < self.min_rows:
            rows = torch.cat([rows, rows[-1:].expand(self.min_rows - m, self.in_features)])
        return self._kernel(rows)[:m].view(*x.shape[:-1], self.out_features)

    def _kernel(self, rows: Tensor) -> Tensor:
        """(M, in_features) -> (M, out_features), one kernel call."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return F.linear(rows, self.weight, self.bias)


class packed_linears:
    """Context manager: inside it, every `nn.Linear` of `model` whose weight `can_pack` runs through a prepacked
    `Linear` (one reordered copy of the weights, freed on exit); outside, the modules are as they were. For frozen
    weights only: the copies are made on entry, so a weight changed inside is not seen."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.patched: list[nn.Linear] = []

    def __enter__(self) -> int:
        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, nn.Linear) and can_pack(module.weight) and "forward" not in module.__dict__:
                    bias = None if module.bias is None else module.bias.detach()
                    module.forward = Linear(module.weight.detach(), bias, True)
                    self.patched.append(module)
        return len(self.patched)

    def __exit__(self, *exc: object) -> None:
        for module in self.patched:
            del module.forward
        self.patched = []

"""Prepacked bf16 linears for CPUs: the weight reordered once into oneDNN's blocked layout, every call through the
prepacked kernel (what inductor's freezing pass does). `F.linear` on a bf16 CPU tensor reorders the whole weight on
each call, so a step that reads each weight once pays for it twice.

Users: eval.engine.forward (the verifier's decode path, and the vocabulary head drafters share) and data.generate
(batched self-distillation, through `packed_linears`). Same results as F.linear, bitwise, on the shapes tested
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

    `min_rows` / `max_rows`: kernels pick their path by row count (on an AMX CPU, oneDNN's bf16 kernels take one
    path up to 32 rows and another above), so a weight gets the row counts [min_rows, max_rows] over which its kernel
    gives every row the same bits (eval.engine.forward probes them per shape, `with_rows`). A call over fewer than
    `min_rows` rows is padded by repeating its last row; one over more than `max_rows` (None: no limit) is split into
    calls of at most `max_rows` rows (the last one padded if short); only the call's own rows come back."""

    def __init__(
        self, weight: Tensor, bias: Tensor | None, packed: bool, min_rows: int = 1, max_rows: int | None = None
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = packed and can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight
        self.min_rows, self.max_rows = min_rows, max_rows

    def with_rows(self, min_rows: int, max_rows: int | None = None) -> Linear:
        """The same weights (shared, not copied), every kernel call over min_rows..max_rows rows."""
        other = copy.copy(self)
        other.min_rows, other.max_rows = min_rows, max_rows
        return other

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if self.max_rows is not None and m > self.max_rows:
            out = torch.cat([self._padded(part) for part in rows.split(self.max_rows)])
        else:
            out = self._padded(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def dense(self, x: Tensor) -> Tensor:
        """All rows of x in one kernel call, whatever their number: the fastest product, deterministic for a given
        shape, but not batch-invariant (a prefill's, which no other forward has to match row for row)."""
        return self._kernel(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def _padded(self, rows: Tensor) -> Tensor:
        m = rows.shape[0]
        if m >= self.min_rows:
            return self._kernel(rows)
        return self._kernel(torch.cat([rows, rows[-1:].expand(self.min_rows - m, self.in_features)]))[:m]

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

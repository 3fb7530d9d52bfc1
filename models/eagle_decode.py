"""The EAGLE-family draft layer at decode time: `net.step`'s arithmetic, bit for bit, in fewer eager ops.

What made the verifier's step fast (eval/engine/forward.py), taken where it keeps the bits of `models.eagle_layers`:
- q/k/v in one weight product and gate/up in another, on fused copies made once per drafter, where this machine's
  kernel gives every output column the bits of the separate products (`fuses`: probed once per shape, dtype and
  thread count for every call size up to FUSED_ROWS; a larger call, a prefill, runs the separate weights as before);
- rotary from a table of the positions' cos / sin (the same `rope` over 0..L-1), rotating q and k in one pass;
- keys and values written into preallocated, append-only buffers (`DraftKV`) and attended in place, no cat of the
  cache per forward (attention over a prefix view of a buffer gives the bits of the same keys made contiguous).
Every product keeps the row count it had (the drafter calls `DecodeStep` with the rows it passed `net.step`), so
every row keeps its bits; the drafter's tests compare the two paths with torch.equal.

Prepacked weights (models.packed, what the engine runs) only for bf16 weights, and only where `packs` finds them
bit-equal to F.linear: oneDNN's prepacked fp32 kernel, like MKL's packed sgemm, rounds otherwise than F.linear
(measured on an AVX512-BF16 CPU), so an export's fp32 weights (how every export loads) keep F.linear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.eagle_layers import RMSNorm, rope
from models.packed import Linear, can_pack

FUSED_ROWS = 64  # calls up to this many rows run the fused weights (probed for each count); larger ones, separate
_FUSES: dict[tuple, bool] = {}


def fuses(weights: Sequence[Tensor], biases: Sequence[Tensor | None], rows: int = FUSED_ROWS) -> bool:
    """Whether one F.linear over the concatenated `weights` gives, column for column, the bits of one F.linear per
    weight, for every call of 1..`rows` rows (random data, this machine's kernels and thread count; memoised)."""
    w0 = weights[0]
    key = (tuple(tuple(w.shape) for w in weights), w0.dtype, w0.device.type, biases[0] is not None, rows,
           torch.get_num_threads())
    if key not in _FUSES:
        gen = torch.Generator().manual_seed(0)
        ws = [torch.randn(w.shape, generator=gen).to(w0) for w in weights]
        bs = [None if b is None else torch.randn(b.shape, generator=gen).to(b) for b in biases]
        cat_w, cat_b = torch.cat(ws), None if bs[0] is None else torch.cat(bs)
        x = torch.randn(rows, w0.shape[1], generator=gen).to(w0)
        _FUSES[key] = all(torch.equal(F.linear(x[:m], cat_w, cat_b),
                                      torch.cat([F.linear(x[:m], w, b) for w, b in zip(ws, bs)], dim=-1))
                          for m in range(1, rows + 1))
    return _FUSES[key]


_PACKS: dict[tuple, bool] = {}


def packs(weight: Tensor, bias: Tensor | None, rows: int = FUSED_ROWS) -> bool:
    """Whether the prepacked kernel (models.packed.Linear: bf16 on a CPU) gives F.linear's bits for `weight`'s shape,
    for every call of 1..`rows` rows (random data, this machine's kernels and thread count; memoised)."""
    if not can_pack(weight):
        return False
    key = (tuple(weight.shape), weight.dtype, bias is not None, rows, torch.get_num_threads())
    if key not in _PACKS:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(weight.shape, generator=gen).to(weight)
        b = None if bias is None else torch.randn(bias.shape, generator=gen).to(bias)
        lin, x = Linear(w, b, True), torch.randn(rows, w.shape[1], generator=gen).to(w)
        _PACKS[key] = all(torch.equal(lin._kernel(x[:m]), F.linear(x[:m], w, b)) for m in range(1, rows + 1))
    return _PACKS[key]


class _Product:
    """F.linear over one module's weight, or several modules' weights concatenated (split after), on a copy made once
    per drafter: the concatenation where it `fuses`, prepacked where it `packs` (bf16 on a CPU), both decided for the
    thread count of the call (kernels split their work by it); calls of up to FUSED_ROWS rows run it, larger ones (a
    prefill) each module's own weight as before."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.linears = list(linears)
        self.sizes = [lin.out_features for lin in linears]
        self._w = [lin.weight.detach() for lin in linears]
        self._b = [None if lin.bias is None else lin.bias.detach() for lin in linears]
        self.weight: Tensor | None = None  # the concatenated copy, made when first fused
        self.bias: Tensor | None = None
        self._packed: Linear | None = None
        self._modes: dict[int, tuple[bool, Linear | None]] = {}  # thread count -> (fused, packed)

    def mode(self) -> tuple[bool, Linear | None]:
        """(whether calls run the concatenated weight, its prepacked form or None) at the current thread count."""
        threads = torch.get_num_threads()
        if threads not in self._modes:
            w, b = self._w, self._b
            fused = len(w) == 1 or fuses(w, b)
            if fused and self.weight is None:
                self.weight = w[0] if len(w) == 1 else torch.cat(w)
                self.bias = b[0] if len(b) == 1 or b[0] is None else torch.cat(b)
            packed = None
            if fused and packs(self.weight, self.bias):
                self._packed = packed = self._packed or Linear(self.weight, self.bias, True)
            self._modes[threads] = (fused and (len(w) > 1 or packed is not None), packed)
        return self._modes[threads]

    def __call__(self, x: Tensor) -> Tensor | list[Tensor]:
        fused, packed = self.mode()
        if fused and x.shape[:-1].numel() <= FUSED_ROWS:
            y = F.linear(x, self.weight, self.bias) if packed is None else packed(x)
            return y if len(self.sizes) == 1 else list(y.split(self.sizes, dim=-1))
        ys = [F.linear(x, lin.weight, lin.bias) for lin in self.linears]
        return ys[0] if len(ys) == 1 else ys


def _rms(norm: RMSNorm, x: Tensor) -> Tensor:
    # models.eagle_layers.RMSNorm.forward, op for op
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * x.to(dtype)


class DraftKV:
    """Append-only key and value buffers (B, H_kv, capacity, hd), grown by doubling: a forward writes its keys at
    slots `at`.. and attends slots 0..at+T-1 in place. Which slots are committed is the caller's business."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def reserve(self, like: Tensor, length: int, keep: int) -> None:
        """Room for `length` slots shaped like `like` (B, H_kv, *, hd), the first `keep` carried over."""
        if self.k is not None and self.k.shape[2] >= length and self.k.dtype == like.dtype \
                and self.k.shape[:2] == like.shape[:2]:
            return
        cap = max(64, 1 << (max(length, 1) - 1).bit_length())
        with torch.inference_mode():
            k = like.new_empty(like.shape[0], like.shape[1], cap, like.shape[3])
            v = torch.empty_like(k)
            if self.k is not None and keep:
                k[:, :, :keep] = self.k[:, :, :keep]
                v[:, :, :keep] = self.v[:, :, :keep]
        self.k, self.v = k, v

    def adopt(self, k: Tensor | None, v: Tensor | None) -> int:
        """Make the committed keys `k`, `v` (B, H_kv, P, hd) (a prefix view of these buffers, or any tensors) slots
        0..P-1; returns P."""
        if k is None:
            return 0
        p = k.shape[2]
        if self.k is None or k.data_ptr() != self.k.data_ptr() or k.stride() != self.k.stride():
            self.k = self.v = None
            self.reserve(k, p, 0)
            with torch.inference_mode():
                self.k[:, :, :p] = k
                self.v[:, :, :p] = v
        return p


class DecodeStep:
    """`net.step` (EAGLE-1, EAGLE-3, P-EAGLE: one draft decoder layer) for decode time, with its weights fused once.

    `__call__(hidden, embeds, positions, mask, kv, at)`: the rows of `hidden` / `embeds` (B, T, D) at `positions`
    (T,) (every batch row alike, as the drafters call it), their keys and values written into `kv` at slots
    at..at+T-1, attending slots 0..at+T-1 under `mask` (B or 1, 1, T, at+T) bool. Returns the output (B, T, D), the
    bits `net.step` gives with past keys = slots 0..at-1."""

    def __init__(self, net: nn.Module) -> None:
        layer = net.layer
        att = layer.self_attn
        self.net, self.layer, self.att = net, layer, att
        self.two_inputs = layer.two_inputs
        self.dtype = net.fc.weight.dtype
        self.heads, self.kv_heads, self.head_dim = att.num_heads, att.num_kv_heads, att.head_dim
        self.qkv = _Product([att.q_proj, att.k_proj, att.v_proj])
        self.o = _Product([att.o_proj])
        self.gate_up = _Product([layer.mlp.gate_proj, layer.mlp.up_proj])
        self.down = _Product([layer.mlp.down_proj])
        self.fc = None if self.two_inputs else _Product([net.fc])
        # EAGLE-3's own head over the draft vocabulary (EAGLE-1 drafts through the verifier's, packed by the drafter)
        self.head = _Product([net.lm_head]) if not net.shares_verifier_head else None
        self._cos: Tensor | None = None  # (L, hd) fp32 rotary tables, as models.eagle_layers.rope computes them
        self._sin: Tensor | None = None

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin at `positions` (T,) -> (T, 1, hd) each, in the model dtype as apply_rope casts them."""
        top = int(positions.max()) + 1
        if self._cos is None or self._cos.shape[0] < top:
            length = max(256, 1 << (top - 1).bit_length())
            with torch.inference_mode():
                cos, sin = rope(torch.arange(length, device=positions.device)[None], self.head_dim,
                                self.att.rope_theta)  # (1, 1, L, hd)
            self._cos, self._sin = cos[0, 0], sin[0, 0]
        return self._cos[positions, None].to(self.dtype), self._sin[positions, None].to(self.dtype)

    @torch.inference_mode()
    def __call__(self, hidden: Tensor, embeds: Tensor, positions: Tensor, mask: Tensor, kv: DraftKV,
                 at: int) -> Tensor:
        layer = self.layer
        bsz, t = hidden.shape[:2]
        h, hq, hkv, hd = hidden.to(self.dtype), self.heads, self.kv_heads, self.head_dim
        if self.two_inputs:  # EAGLE-3: cat(norm(embed), norm(hidden)); the residual is hidden
            x = torch.cat([_rms(layer.input_layernorm, embeds.to(self.dtype)), _rms(layer.hidden_norm, h)], dim=-1)
        else:  # EAGLE-1: fc(cat(embed, hidden)) is both the input and the residual
            h = x = self.fc(torch.cat([embeds.to(self.dtype), h], dim=-1))
        q, k, v = self.qkv(x)
        # Rotary on q and k together (elementwise: the bits of rotating each), as apply_rope does it.
        qk = torch.cat([q, k], dim=-1).view(bsz, t, hq + hkv, hd)  # (B, T, H + H_kv, hd)
        cos, sin = self.rotary(positions)
        x1, x2 = qk.chunk(2, dim=-1)
        qk = (qk * cos) + (torch.cat([-x2, x1], dim=-1) * sin)
        kv.reserve(qk.new_empty(bsz, hkv, 0, hd), at + t, at)
        kv.k[:, :, at : at + t] = qk[:, :, hq:].transpose(1, 2)
        kv.v[:, :, at : at + t] = v.view(bsz, t, hkv, hd).transpose(1, 2)
        q = qk[:, :, :hq].transpose(1, 2)  # (B, H, T, hd)
        out = F.scaled_dot_product_attention(q, kv.k[:, :, : at + t], kv.v[:, :, : at + t], attn_mask=mask,
                                             enable_gqa=hq != hkv)
        h = h + self.o(out.transpose(1, 2).reshape(bsz, t, hq * hd))
        gate, up = self.gate_up(_rms(layer.post_attention_layernorm, h))
        return h + self.down(F.silu(gate) * up)

    @torch.inference_mode()
    def logits(self, out: Tensor) -> Tensor:
        """EAGLE-3's `net.logits`: its head over the final-normed output. (..., D) -> (..., V_draft)"""
        return self.head(_rms(self.net.norm, out))

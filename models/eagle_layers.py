"""A Llama-family decoder layer for EAGLE drafters, with the tensor names vLLM and SGLang load.

Written here (not borrowed from transformers) because the drafter needs what HF layers don't give directly: a
2h-wide attention input (EAGLE-3), arbitrary boolean masks over keys from earlier unrolled steps (training-time test)
and tree masks at decode time, and a KV cache it can roll back. Names follow Llama: `self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm` (+ `hidden_norm` for EAGLE-3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin for rotary embeddings at `positions` (B, T) -> (B, 1, T, head_dim) each."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, hd)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))


@dataclass(frozen=True)
class UnrollMask:
    """The attention pattern of unrolled training step `step` (EAGLE-3's training-time test), kept factored. The
    step's queries sit in W columns (step 0: every position, W = n; later steps: the window of positions whose
    targets need them, `models.eagle.unroll`). Query w sees the step-0 keys `keys` marks ((B, 1, W, n) bool: those
    at positions s <= its own t, not padding) and, for each step 1..`step`, that step's key in its own column. The
    dense (B, 1, n, (step + 1) n) form is `models.eagle.unroll_mask`; this one costs W n + step W per head.
    `is_causal`: `keys` is the plain causal pattern (step 0 over right-padded rows), which the fused kernel applies
    without reading a mask (queries at padding positions then also see padding keys: nothing reads their outputs)."""

    keys: Tensor
    step: int
    is_causal: bool = False


def unrolled_attention(q: Tensor, k0: Tensor, v0: Tensor, kd: Tensor | None, vd: Tensor | None, mask: UnrollMask,
                       scale: float) -> Tensor:
    """Attention of q (B, H, W, hd) over the step-0 keys/values k0, v0 (B, H_kv, n, hd) under `mask.keys`, plus
    each query's own keys/values of steps 1..J, kd, vd (B, H_kv, W, J, hd) (None at step 0), softmaxed together.
    Returns (B, H, W, hd). On a CPU: `_FlashUnrolled` (PyTorch's fused flash kernel for the step-0 block, no W x n
    tensor kept for backward); elsewhere `factored_attention`."""
    if q.device.type == "cpu":
        bias = None if mask.is_causal else torch.zeros((), dtype=q.dtype).masked_fill(~mask.keys, float("-inf"))
        if kd is None:
            kd = vd = q.new_empty(q.shape[0], k0.shape[1], q.shape[2], 0, q.shape[3])
        return _FlashUnrolled.apply(q, k0.to(q.dtype), v0.to(q.dtype), kd.to(q.dtype), vd.to(q.dtype), bias, scale)
    return factored_attention(q, k0, v0, kd, vd, mask, scale)


def factored_attention(q: Tensor, k0: Tensor, v0: Tensor, kd: Tensor | None, vd: Tensor | None, mask: UnrollMask,
                       scale: float) -> Tensor:
    """`unrolled_attention` through autograd, any device: one (W x n) score block against the step-0 keys plus each
    query's J own later keys (row-wise dot products), softmaxed together."""
    bsz, heads, width, hd = q.shape
    kv_heads, n = k0.shape[1], k0.shape[2]
    qg = q.reshape(bsz, kv_heads, heads // kv_heads, width, hd)
    scores = torch.matmul(qg, k0.to(q.dtype)[:, :, None].transpose(-1, -2)).float() * scale  # (B, H_kv, G, W, n)
    scores = scores.masked_fill(~mask.keys[:, :, None], float("-inf"))
    if kd is not None:
        diag = torch.einsum("bkgwd,bkwjd->bkgwj", qg, kd.to(q.dtype)).float() * scale  # (B, H_kv, G, W, J)
        scores = torch.cat([scores, diag], dim=-1)
    probs = scores.softmax(-1).to(q.dtype)
    out = torch.matmul(probs[..., :n], v0.to(q.dtype)[:, :, None])  # (B, H_kv, G, W, hd)
    if kd is not None:
        out = out + torch.einsum("bkgwj,bkwjd->bkgwd", probs[..., n:], vd.to(q.dtype))
    return out.reshape(bsz, heads, width, hd)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _FlashUnrolled(torch.autograd.Function):
    """`unrolled_attention` on a CPU, forward and backward by hand. The step-0 block runs PyTorch's fused flash
    kernel (causal, or under the additive mask `bias`), which returns its log-sum-exp L_0 per query; the J diagonal
    scores d_j = q . k_j (one key per query per later step) are small, (W, J) per head. The full softmax's
    normaliser is L = logaddexp(L_0, logsumexp_j d_j), so

        out = exp(L_0 - L) out_0 + sum_j exp(d_j - L) v_j.

    Backward: the flash kernel's backward, given this full `out` and full L, computes exactly the step-0 block's
    share of the gradient (its probabilities exp(s - L) and its row term dO . out are the full softmax's); the
    diagonal's share is written out: dS_j = p_j (dO . v_j - dO . out). Math in fp32 outside the flash kernel."""

    @staticmethod
    def forward(ctx, q: Tensor, k0: Tensor, v0: Tensor, kd: Tensor, vd: Tensor, bias: Tensor | None,
                scale: float) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):
            bsz, heads, width, hd = q.shape
            kv_heads, group, later = k0.shape[1], heads // k0.shape[1], kd.shape[3]  # later: J
            k0h, v0h = k0.repeat_interleave(group, dim=1), v0.repeat_interleave(group, dim=1)
            out0, lse0 = _flash(q, k0h, v0h, 0.0, bias is None, attn_mask=bias, scale=scale)  # (B,H,W,hd), (B,H,W)
            ctx.scale, ctx.group = scale, group
            if later == 0:
                ctx.save_for_backward(q, k0h, v0h, bias, out0, lse0)
                return out0
            qg = q.view(bsz, kv_heads, group, width, hd).transpose(2, 3).float()  # (B, H_kv, W, G, hd)
            kdf, vdf = kd.float(), vd.float()  # (B, H_kv, W, J, hd): each query's own later keys
            d = torch.matmul(qg, kdf.transpose(-1, -2)).mul_(scale)  # (B, H_kv, W, G, J)
            l0 = lse0.view(bsz, kv_heads, group, width).transpose(2, 3)  # (B, H_kv, W, G)
            lse = torch.logaddexp(l0, torch.logsumexp(d, dim=-1))
            pd = d.sub_(lse[..., None]).exp_()  # the diagonal keys' probabilities
            o0 = out0.view(bsz, kv_heads, group, width, hd).transpose(2, 3)
            out = torch.matmul(pd, vdf).add_((l0 - lse).exp_()[..., None] * o0)  # (B, H_kv, W, G, hd)
            out = out.transpose(2, 3).reshape(bsz, heads, width, hd).to(q.dtype)
            lse = lse.transpose(2, 3).reshape(bsz, heads, width).contiguous()
            ctx.save_for_backward(q, k0h, v0h, bias, out, lse, pd, qg, kdf, vdf)
            return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        with torch.autocast(dout.device.type, enabled=False):
            q, k0h, v0h, bias, out, lse, *diag = ctx.saved_tensors
            bsz, heads, width, hd = q.shape
            group = ctx.group
            kv_heads, n = heads // group, k0h.shape[2]
            dout = dout.to(q.dtype).contiguous()
            dq, dk0, dv0 = _flash_backward(dout, q, k0h, v0h, out, lse, 0.0, bias is None, attn_mask=bias,
                                           scale=ctx.scale)
            dk0 = dk0.view(bsz, kv_heads, group, n, hd).sum(2).to(k0h.dtype)  # GQA: a key serves G heads
            dv0 = dv0.view(bsz, kv_heads, group, n, hd).sum(2).to(v0h.dtype)
            if not diag:
                return dq, dk0, dv0, None, None, None, None
            pd, qg, kdf, vdf = diag
            do = dout.view(bsz, kv_heads, group, width, hd).transpose(2, 3).float()  # (B, H_kv, W, G, hd)
            row = (do * out.view(bsz, kv_heads, group, width, hd).transpose(2, 3).float()).sum(-1)  # dO . out
            ds = pd * torch.matmul(do, vdf.transpose(-1, -2)).sub_(row[..., None])  # (B, H_kv, W, G, J)
            dq = dq.float().view(bsz, kv_heads, group, width, hd).add_(
                torch.matmul(ds, kdf).mul_(ctx.scale).transpose(2, 3))
            dkd = torch.matmul(ds.transpose(-1, -2), qg).mul_(ctx.scale)  # (B, H_kv, W, J, hd)
            dvd = torch.matmul(pd.transpose(-1, -2), do)
            return dq.view(bsz, heads, width, hd).to(q.dtype), dk0, dv0, dkd.to(q.dtype), dvd.to(q.dtype), None, None


class DraftAttention(nn.Module):
    """Multi-head attention (GQA) over the current tokens plus any past keys/values the caller passes in."""

    def __init__(self, in_dim: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.rope_theta = head_dim, rope_theta
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def project_kv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated keys and values for x. (B, T, in) -> 2 x (B, H_kv, T, hd)"""
        bsz, seqlen, _ = x.shape
        k = self.k_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope(positions, self.head_dim, self.rope_theta)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | UnrollMask, past_k: Tensor | list | None = None,
                past_v: Tensor | list | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, in); positions (B, T); mask (B, 1, T, S_past + T) bool, True = may attend, with past_k/past_v
        (B, H_kv, S_past, hd) or None; or an UnrollMask, with past_k/past_v the lists of earlier unrolled steps'
        keys/values (step 0's (B, H_kv, n, hd), then one (B, H_kv, W, hd) per later step; None at step 0).

        Returns (output (B, T, D), k, v) where k, v are this call's own keys/values (B, H_kv, T, hd), so the
        caller decides what to keep (a cache, or the keys of one unrolled training step).
        """
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        cos, sin = rope(positions, self.head_dim, self.rope_theta)
        q = apply_rope(q, cos, sin)
        k, v = self.project_kv(x, positions)
        if isinstance(mask, UnrollMask):
            if past_k:  # a later step: step 0's keys, and this query's own keys of steps 1..j
                kd, vd = torch.stack([*past_k[1:], k], dim=3), torch.stack([*past_v[1:], v], dim=3)
                out = unrolled_attention(q, past_k[0], past_v[0], kd, vd, mask, self.head_dim**-0.5)
            else:
                out = unrolled_attention(q, k, v, None, None, mask, self.head_dim**-0.5)
        else:
            keys = k if past_k is None else torch.cat([past_k, k], dim=2)  # (B, H_kv, S, hd)
            values = v if past_v is None else torch.cat([past_v, v], dim=2)
            out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.num_heads * self.head_dim)
        return self.o_proj(out), k, v


class DraftMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """One Llama-style layer.

    `two_inputs=False` (EAGLE-1): input is the fused h-wide vector; the input norm is dropped (layer 0 of the
    EAGLE-1 reference has none). `two_inputs=True` (EAGLE-3): input is cat(norm(embedding), norm(hidden)), 2h wide,
    and the residual stream is the hidden part.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, eps: float, two_inputs: bool, attention_bias: bool = False) -> None:
        super().__init__()
        self.two_inputs = two_inputs
        if two_inputs:
            self.input_layernorm = RMSNorm(hidden_size, eps)
            self.hidden_norm = RMSNorm(hidden_size, eps)
        in_dim = 2 * hidden_size if two_inputs else hidden_size
        self.self_attn = DraftAttention(in_dim, hidden_size, num_heads, num_kv_heads, head_dim, rope_theta,
                                        attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = DraftMLP(hidden_size, intermediate_size)

    def attn_input(self, hidden: Tensor, embeds: Tensor | None) -> Tensor:
        if self.two_inputs:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2D)
        return hidden

    def forward(self, hidden: Tensor, embeds: Tensor | None, positions: Tensor, mask: Tensor,
                past_k: Tensor | None = None, past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (output (B, T, D), k, v) of this call's tokens."""
        attn, k, v = self.self_attn(self.attn_input(hidden, embeds), positions, mask, past_k, past_v)
        hidden = hidden + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, k, v

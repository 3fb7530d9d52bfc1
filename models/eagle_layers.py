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
    """The attention pattern of unrolled training step `step` (EAGLE-3's training-time test), kept factored: query t
    sees the step-0 keys s <= t that are not padding (`causal`, (B, 1, n, n) bool) and, for each later step, only
    that step's key at its own position t. `models.eagle.unroll_mask` is the same pattern as one dense
    (B, 1, n, (step + 1) n) mask; attending through it costs (step + 1) n^2 per head, where this form costs n^2 + step n.
    `keys_prefix`: every row's valid keys are a prefix (right padding, or none), so a plain causal mask gives every
    valid query exactly its keys (outputs at padding positions are then unspecified: nothing reads them)."""

    causal: Tensor
    step: int
    keys_prefix: bool = False


def unrolled_attention(q: Tensor, keys: Tensor, values: Tensor, mask: UnrollMask, scale: float) -> Tensor:
    """Attention of q (B, H, n, hd) over keys/values (B, H_kv, (step + 1) n, hd) laid out step by step, under
    `mask`: the step-0 keys causally, plus, per later step, the key at the query's own position, softmaxed together.
    Returns (B, H, n, hd). On a CPU with right-padded rows it runs `_FlashUnrolled` (fused causal attention for the
    n x n block, no n x n tensor kept); otherwise `factored_attention`."""
    if mask.keys_prefix and q.device.type == "cpu":
        return _FlashUnrolled.apply(q, keys.contiguous(), values.contiguous(), mask.step + 1, scale)
    return factored_attention(q, keys, values, mask, scale)


def factored_attention(q: Tensor, keys: Tensor, values: Tensor, mask: UnrollMask, scale: float) -> Tensor:
    """`unrolled_attention` through autograd, any mask and device: one (n x n) score block against the step-0 keys
    plus, per later step, the score of each query with that step's key at its own position (a row-wise dot
    product), softmaxed together."""
    bsz, heads, n, hd = q.shape
    kv_heads, steps = keys.shape[1], mask.step + 1
    group = heads // kv_heads
    qg = q.reshape(bsz, kv_heads, group, n, hd)
    k = keys.reshape(bsz, kv_heads, steps, n, hd)
    v = values.reshape(bsz, kv_heads, steps, n, hd)
    causal = torch.matmul(qg, k[:, :, :1].transpose(-1, -2)).float() * scale  # (B, H_kv, G, n, n)
    causal = causal.masked_fill(~mask.causal[:, :, None], float("-inf"))
    diag = (qg[:, :, :, None] * k[:, :, None, 1:]).sum(-1).float() * scale  # (B, H_kv, G, step, n)
    probs = torch.cat([causal, diag.transpose(-1, -2)], dim=-1).softmax(-1).to(q.dtype)  # (B, H_kv, G, n, n + step)
    out = torch.matmul(probs[..., :n], v[:, :, :1])  # (B, H_kv, G, n, hd)
    if mask.step:
        out = out + (probs[..., n:].transpose(-1, -2)[..., None] * v[:, :, None, 1:]).sum(3)
    return out.reshape(bsz, heads, n, hd)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _FlashUnrolled(torch.autograd.Function):
    """`unrolled_attention` for right-padded rows on a CPU, forward and backward by hand. The step-0 block runs
    PyTorch's fused causal flash kernel, which returns its log-sum-exp L_c per query; the J = steps - 1 diagonal
    scores d_j = q . k_j (one key per query per later step) are small, (n, J) per head. The full softmax's
    normaliser is L = logaddexp(L_c, logsumexp_j d_j), so

        out = exp(L_c - L) out_c + sum_j exp(d_j - L) v_j.

    Backward: the flash kernel's backward, given this full `out` and full L, computes exactly the step-0 block's
    share of the gradient (its probabilities exp(s - L) and its row term dO . out are the full softmax's); the
    diagonal's share is written out: dS_j = p_j (dO . v_j - dO . out). Math in fp32 outside the flash kernel."""

    @staticmethod
    def forward(ctx, q: Tensor, keys: Tensor, values: Tensor, steps: int, scale: float) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):
            bsz, heads, n, hd = q.shape
            kv_heads = keys.shape[1]
            group = heads // kv_heads
            k = keys.to(q.dtype).view(bsz, kv_heads, steps, n, hd)
            v = values.to(q.dtype).view(bsz, kv_heads, steps, n, hd)
            k0, v0 = k[:, :, 0].repeat_interleave(group, dim=1), v[:, :, 0].repeat_interleave(group, dim=1)
            out_c, lse_c = _flash(q, k0, v0, 0.0, True, scale=scale)  # (B, H, n, hd), (B, H, n)
            ctx.scale, ctx.steps, ctx.shape, ctx.dtypes = scale, steps, (bsz, kv_heads, group, n, hd), (keys.dtype, values.dtype)
            if steps == 1:
                ctx.save_for_backward(q, k0, v0, out_c, lse_c)
                return out_c
            qg = q.view(bsz, kv_heads, group, n, hd).transpose(2, 3).float()  # (B, H_kv, n, G, hd)
            kd = k[:, :, 1:].permute(0, 1, 3, 2, 4).float()  # (B, H_kv, n, J, hd): each query's own later keys
            vd = v[:, :, 1:].permute(0, 1, 3, 2, 4).float()
            d = torch.matmul(qg, kd.transpose(-1, -2)).mul_(scale)  # (B, H_kv, n, G, J)
            lc = lse_c.view(bsz, kv_heads, group, n).transpose(2, 3)  # (B, H_kv, n, G)
            lse = torch.logaddexp(lc, torch.logsumexp(d, dim=-1))
            pd = d.sub_(lse[..., None]).exp_()  # the diagonal keys' probabilities
            oc = out_c.view(bsz, kv_heads, group, n, hd).transpose(2, 3)
            out = torch.matmul(pd, vd).add_((lc - lse).exp_()[..., None] * oc)  # (B, H_kv, n, G, hd)
            out = out.transpose(2, 3).reshape(bsz, heads, n, hd).to(q.dtype)
            lse = lse.transpose(2, 3).reshape(bsz, heads, n).contiguous()
            ctx.save_for_backward(q, k0, v0, out, lse, pd, qg, kd, vd)
            return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        with torch.autocast(dout.device.type, enabled=False):
            bsz, kv_heads, group, n, hd = ctx.shape
            heads = kv_heads * group
            q, k0, v0, out, lse, *diag = ctx.saved_tensors
            dout = dout.to(q.dtype).contiguous()
            dq, dk0, dv0 = _flash_backward(dout, q, k0, v0, out, lse, 0.0, True, scale=ctx.scale)
            dk0 = dk0.view(bsz, kv_heads, group, 1, n, hd).sum(2, dtype=torch.float32)  # GQA: a key serves G heads
            dv0 = dv0.view(bsz, kv_heads, group, 1, n, hd).sum(2, dtype=torch.float32)
            if ctx.steps == 1:
                return dq, dk0.view(bsz, kv_heads, n, hd).to(ctx.dtypes[0]), dv0.view(bsz, kv_heads, n, hd).to(ctx.dtypes[1]), None, None
            pd, qg, kd, vd = diag
            do = dout.view(bsz, kv_heads, group, n, hd).transpose(2, 3).float()  # (B, H_kv, n, G, hd)
            row = (do * out.view(bsz, kv_heads, group, n, hd).transpose(2, 3).float()).sum(-1)  # dO . out
            ds = pd * torch.matmul(do, vd.transpose(-1, -2)).sub_(row[..., None])  # (B, H_kv, n, G, J)
            dq = dq.float().view(bsz, kv_heads, group, n, hd).add_(torch.matmul(ds, kd).mul_(ctx.scale).transpose(2, 3))
            dkd = torch.matmul(ds.transpose(-1, -2), qg).mul_(ctx.scale).permute(0, 1, 3, 2, 4)  # (B, H_kv, J, n, hd)
            dvd = torch.matmul(pd.transpose(-1, -2), do).permute(0, 1, 3, 2, 4)
            dk = torch.cat([dk0, dkd], dim=2).reshape(bsz, kv_heads, ctx.steps * n, hd)
            dv = torch.cat([dv0, dvd], dim=2).reshape(bsz, kv_heads, ctx.steps * n, hd)
            return dq.view(bsz, heads, n, hd).to(q.dtype), dk.to(ctx.dtypes[0]), dv.to(ctx.dtypes[1]), None, None


class DraftAttention(nn.Module):
    """Multi-head attention (GQA) over the current tokens plus any past keys/values the caller passes in."""

    def __init__(self, in_dim: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = num_heads, num_kv_heads, head_dim, rope_theta
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

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor, past_k: Tensor | None = None,
                past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, in); positions (B, T); mask (B, 1, T, S_past + T) bool, True = may attend, or an UnrollMask.

        Returns (output (B, T, D), k, v) where k, v are this call's own keys/values (B, H_kv, T, hd), so the
        caller decides what to keep (a cache, or the keys of one unrolled training step).
        """
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        cos, sin = rope(positions, self.head_dim, self.rope_theta)
        q = apply_rope(q, cos, sin)
        k, v = self.project_kv(x, positions)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)  # (B, H_kv, S, hd)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        if isinstance(mask, UnrollMask):
            out = unrolled_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, self.head_dim**-0.5)
        else:
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

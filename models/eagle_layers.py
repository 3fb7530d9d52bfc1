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
    (B, 1, n, (step + 1) n) mask; attending through it costs (step + 1) n^2 per head, where this form costs n^2 + step n."""

    causal: Tensor
    step: int


def unrolled_attention(q: Tensor, keys: Tensor, values: Tensor, mask: UnrollMask, scale: float) -> Tensor:
    """Attention of q (B, H, n, hd) over keys/values (B, H_kv, (step + 1) n, hd) laid out step by step, under
    `mask`: one (n x n) score block against the step-0 keys plus, per later step, the score of each query with that
    step's key at its own position (a row-wise dot product), softmaxed together. Returns (B, H, n, hd)."""
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

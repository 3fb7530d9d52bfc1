"""Medusa heads (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads").

K heads read the verifier's last hidden state h_t (the input of its lm_head). Head k (1-based) predicts token
t+k+1; the verifier's own head predicts t+1. Each head is `num_layers` residual blocks `x + SiLU(Linear(x))`,
zero-initialised so that a fresh head starts as the verifier's own head, then a vocabulary projection.

Module and tensor names follow vLLM's Medusa layout (`blocks.{h}.layers.{l}.weight|bias`, `lm_heads.{h}.weight` or
one shared `lm_head.weight` with `original_lm_head: true`), so `state_dict()` is the export (models/exports/io.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ResidualBlock(nn.Module):
    """`num_layers` times x <- x + SiLU(W x + b); each layer its own Linear (the reference's `[ResBlock] * L`
    shares a single block by mistake)."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers))
        self.act = nn.SiLU()
        for layer in self.layers:  # x + SiLU(0) = x: a fresh head begins exactly as the verifier's own head
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads. With `share_lm_head`, the vocabulary projection is the verifier's own (frozen, passed in at
    call time, never stored here); otherwise each head owns a projection initialised from the verifier's."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        share_lm_head: bool = True,
        lm_head_init: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.share_lm_head = num_heads, num_layers, share_lm_head
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers) for _ in range(num_heads))
        self.lm_heads: nn.ModuleList | None = None
        if not share_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
            if lm_head_init is not None:
                for head in self.lm_heads:
                    head.weight.data.copy_(lm_head_init)

    def head_features(self, hidden: Tensor, k: int) -> Tensor:
        """Features of head k (0-based) before its vocabulary projection. (..., D) -> (..., D)"""
        return self.blocks[k](hidden)

    def head_logits(self, hidden: Tensor, k: int, lm_head: nn.Module | None = None) -> Tensor:
        """Logits of head k (0-based), predicting token t+k+2 from h_t. (..., D) -> (..., V)"""
        proj = lm_head if self.share_lm_head else self.lm_heads[k]
        if proj is None:
            raise ValueError("MedusaHeads(share_lm_head=True) needs the verifier's lm_head passed in.")
        feats = self.head_features(hidden, k)
        return proj(feats.to(proj.weight.dtype))  # a shared frozen head may be bf16 while the blocks train in fp32

    @property
    def shares_verifier_head(self) -> bool:
        """Drafts through the verifier's lm_head (so `draft_vocab` can cut its rows)."""
        return self.share_lm_head


def medusa_targets(input_ids: Tensor, loss_mask: Tensor, num_heads: int) -> list[tuple[Tensor, Tensor]]:
    """Per-head (targets, valid) aligned with hidden positions t = 0..T-1.

    Head k (0-based) at position t predicts token t+k+2. Positions whose target falls off the end, or whose target
    is not an assistant token (`loss_mask` 0), are invalid. Returns K pairs of (B, T) tensors.
    """
    bsz, seqlen = input_ids.shape
    out = []
    for k in range(num_heads):
        shift = k + 2
        targets = torch.zeros_like(input_ids)
        valid = torch.zeros_like(loss_mask, dtype=torch.bool)
        if seqlen > shift:
            targets[:, : seqlen - shift] = input_ids[:, shift:]
            valid[:, : seqlen - shift] = loss_mask[:, shift:].bool()
        out.append((targets, valid))
    return out

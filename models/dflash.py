"""DFlash (arXiv 2602.06036): a block drafter conditioned on several verifier layers; one forward drafts a block.

The context is the verifier's own: at every committed position t, ctx_t = hidden_norm(fc(cat(aux features at t)))
(the EAGLE-3 feature layers by default), and each draft layer turns it into that layer's keys and values (its k/v
projections, k_norm, rotary at t); the context never passes through the layers. A round's block is the root token
x_n at position n followed by K = block_size - 1 mask tokens at n+1..n+K, embedded with the verifier's embedding; the
block's rows attend every context position and each other (bidirectional within the block) through
`num_layers` Qwen3-style layers (q_norm / k_norm per head), then the final norm; mask slot k's output, through the
verifier's own head, is the distribution of x_{n+k}. So one forward gives K marginals, none conditioned on the
drafts before it, and a Medusa-style tree fills from them.

Training (`block_rows`) samples anchors per sequence: a block at anchor a = t+1 (t the last context position) sees
the context at positions <= t and predicts x_{t+k+1} at slot k, exactly as at decode time; the loss per slot k is the
cross-entropy to q at position t+k (the verifier's distribution of x_{t+k+1}), weighted decay^(k-1).

This layout is the one vLLM's DFlash loads (`qwen3_dflash`: `fc`, `hidden_norm`, `layers.{i}.self_attn.{q,k,v,o}_proj`,
`q_norm`, `k_norm`, the layer norms, `mlp`, `norm`; the embedding and head shared with the verifier).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.eagle import UnrolledStep, VerifierFedNet, check_aux_layers, default_aux_layers, layer_config, step_inputs
from models.eagle_layers import DraftMLP, RMSNorm, apply_rope, rope
from models.peagle import check_mask_token
from runtime.errors import UserError


def check_block_size(block_size: Any, window: int | None = None, where: str = "model.block_size") -> int:
    """A block holds the root and K = block_size - 1 drafts: at least 2, and the window must hold it."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise UserError(f"{where}={block_size!r}: a block is the root token and its drafts, so give a whole number "
                        f">= 2 (DFlash's published recipes use 8 or 16).")
    if window is not None and block_size >= window:
        raise UserError(f"{where}={block_size}: the verifier's window ({window} positions) cannot hold a block of "
                        f"{block_size} after a prompt; use a block_size below {window} (an export: retrain it with a "
                        f"smaller model.block_size).")
    return int(block_size)


class DFlashLayer(nn.Module):
    """A Qwen3-style decoder layer (per-head q_norm / k_norm before rotary) whose attention also reads the context's
    keys and values, which `context_kv` makes from the fused verifier features."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, eps: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.rope_theta = head_dim, rope_theta
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.self_attn.q_norm = RMSNorm(head_dim, eps)
        self.self_attn.k_norm = RMSNorm(head_dim, eps)
        self.mlp = DraftMLP(hidden_size, intermediate_size)

    def _heads(self, x: Tensor, proj: nn.Linear, heads: int) -> Tensor:
        return proj(x).view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)  # (B, heads, T, hd)

    def context_kv(self, ctx: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The context's keys and values for this layer. ctx (B, T, D), positions (B, T) -> 2 x (B, H_kv, T, hd)"""
        a = self.self_attn
        cos, sin = rope(positions, self.head_dim, self.rope_theta)
        k = apply_rope(a.k_norm(self._heads(ctx, a.k_proj, self.num_kv_heads)), cos, sin)
        return k, self._heads(ctx, a.v_proj, self.num_kv_heads)

    def attend(self, h: Tensor, positions: Tensor, mask: Tensor, ctx_k: Tensor, ctx_v: Tensor) -> Tensor:
        """The attention of the normed block rows h (B, M, D) over [context keys, block keys] (mask (B, 1, M, T + M)),
        through o_proj: the part every block layer shares (DFlash2's wraps it in its convolutions). (B, M, D)"""
        a = self.self_attn
        cos, sin = rope(positions, self.head_dim, self.rope_theta)
        q = apply_rope(a.q_norm(self._heads(h, a.q_proj, self.num_heads)), cos, sin)
        k = apply_rope(a.k_norm(self._heads(h, a.k_proj, self.num_kv_heads)), cos, sin)
        v = self._heads(h, a.v_proj, self.num_kv_heads)
        keys = torch.cat([ctx_k.to(q.dtype), k], dim=2)
        values = torch.cat([ctx_v.to(q.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return a.o_proj(out.transpose(1, 2).reshape(*h.shape[:2], -1))

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor, ctx_k: Tensor, ctx_v: Tensor) -> Tensor:
        """x (B, M, D) the block rows; mask (B, 1, M, T + M) over [context keys, block keys]."""
        x = x + self.attend(self.input_layernorm(x), positions, mask, ctx_k, ctx_v)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashNet(VerifierFedNet):
    """DFlash's drafter (see the module docstring); the embedding and the vocabulary head are the verifier's. A
    parallel drafter of the EAGLE line: the verifier's features as EAGLE-3 fuses them, no unrolled step."""

    kind = "dflash"
    shares_verifier_head = True  # drafts through the verifier's lm_head (so `draft_vocab` can cut its rows)
    feature_noise = False  # trained on the verifier's features as they are

    def __init__(self, hidden_size: int, intermediate_size: int, num_attention_heads: int, num_key_value_heads: int,
                 head_dim: int, rope_theta: float, rms_norm_eps: float, vocab_size: int, num_verifier_layers: int,
                 mask_token_id: int, block_size: int = 8, num_layers: int = 1,
                 aux_layer_ids: Sequence[int] | None = None, attention_bias: bool = False) -> None:
        if attention_bias:
            raise UserError("DFlash's layers have no attention biases (vLLM's qwen3_dflash); this verifier's family "
                            "has them, and a DFlash drafter for it is not supported.")
        super().__init__(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
                         rope_theta, rms_norm_eps, vocab_size, num_verifier_layers)
        self.draft_vocab_size = vocab_size
        self.mask_token_id = check_mask_token(mask_token_id, vocab_size)
        self.block_size = check_block_size(block_size)
        self.parallel = self.block_size - 1  # drafts per forward
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise UserError(f"model.num_layers={num_layers!r}: give the number of draft layers, a whole number >= 1.")
        ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layers(num_verifier_layers)
        check_aux_layers(ids, num_verifier_layers, "DFlash aux_layer_ids")
        self.aux_layer_ids = [int(i) for i in ids]
        self.rope_theta, self.eps = rope_theta, rms_norm_eps
        self.shape = dict(intermediate_size=intermediate_size, num_attention_heads=num_attention_heads,
                          num_key_value_heads=num_key_value_heads, head_dim=head_dim)
        self.fc = nn.Linear(len(self.aux_layer_ids) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(hidden_size, rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(hidden_size, intermediate_size, num_attention_heads,
                                                 num_key_value_heads, head_dim, rope_theta, rms_norm_eps)
                                     for _ in range(num_layers)])
        self.norm = RMSNorm(hidden_size, rms_norm_eps)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.aux_layer_ids)

    def features(self, hidden_states: Sequence[Tensor] | dict[int, Tensor]) -> Tensor:
        """The context at each position: hidden_norm(fc(cat(aux features))). (B, T, D)"""
        cat = torch.cat([hidden_states[i] for i in self.aux_layer_ids], dim=-1).to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(cat))

    def context_kv(self, ctx: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Every layer's context keys and values, stacked. -> 2 x (L, B, H_kv, T, hd)"""
        kv = [layer.context_kv(ctx, positions) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def block(self, embeds: Tensor, positions: Tensor, mask: Tensor, ctx_k: Tensor, ctx_v: Tensor) -> Tensor:
        """The block rows through every layer and the final norm: what the verifier's head reads. (B, M, D)"""
        x = embeds.to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, mask, ctx_k[i], ctx_v[i])
        return self.norm(x)

    def logits(self, out: Tensor, verifier_lm_head: nn.Module | None = None) -> Tensor:
        return verifier_lm_head(out.to(verifier_lm_head.weight.dtype))


def block_rows(net: DFlashNet, feats: Tensor, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor,
               embed: nn.Module, steps: int, num_anchors: int | None = 64,
               generator: torch.Generator | None = None) -> Iterator[UnrolledStep]:
    """DFlash's training forward over a batch, in EAGLE's alignment (models.eagle.unroll): for each sampled position t
    (the block's context ends at t; its anchor is a = t+1, the root x_{t+1}), slot k = 1..`steps` predicts x_{t+k+1},
    yielded as step j = k-1 (`UnrolledStep.position` = t, target validity `step_inputs(..., j)`). A t is a candidate
    where its slot-1 target is an assistant token; at most `num_anchors` per row (None: all) are drawn. feats: (B, n, D)
    the context at t = 0..n-1, n = T-1."""
    bsz, n = feats.shape[:2]
    dev = input_ids.device
    size = steps + 1  # the root and its drafts
    inputs = [step_inputs(input_ids, loss_mask, j) for j in range(steps)]
    cand = inputs[0][1]  # (B, n): x_{t+2} is an assistant token
    noise = torch.rand(cand.shape, generator=generator, device=dev)
    score = torch.where(cand, noise, torch.full_like(noise, 2.0))
    order = score.argsort(dim=-1)
    take = cand.sum(-1) if num_anchors is None else cand.sum(-1).clamp(max=num_anchors)  # (B,)
    count = max(int(take.max()), 1)
    t = order[:, :count].sort(dim=-1).values  # (B, A) candidate positions first, then sorted by position
    real = torch.arange(count, device=dev)[None] < take[:, None]  # (B, A)
    t = torch.where(real, t, 0)
    # Rows: anchor i's slot k at column i * size + k, position t + 1 + k.
    k = torch.arange(size, device=dev)
    pos = (t[:, :, None] + 1 + k).reshape(bsz, -1)  # (B, M)
    root = input_ids.gather(1, t + 1)  # (B, A): x_{t+1}
    tokens = torch.cat([root[:, :, None], torch.full((bsz, count, steps), net.mask_token_id, device=dev)], dim=2)
    with torch.no_grad():
        emb = embed(tokens.reshape(bsz, -1))  # (B, M, D)
    width = count * size
    valid_keys = attention_mask[:, :n].bool()
    ctx_mask = (torch.arange(n, device=dev)[None, None] <= t.repeat_interleave(size, dim=1)[..., None])
    ctx_mask &= valid_keys[:, None, :]  # (B, M, n): the context up to t, not padding
    anchor = torch.arange(count, device=dev).repeat_interleave(size)
    own = (anchor[:, None] == anchor[None, :])[None].expand(bsz, width, width)  # the own block, both ways
    mask = torch.cat([ctx_mask, own], dim=-1)[:, None]  # (B, 1, M, n + M)
    positions = torch.arange(n, device=dev)[None].expand(bsz, n)
    ctx_k, ctx_v = net.context_kv(feats, positions)
    out = net.block(emb, pos, mask, ctx_k, ctx_v)  # (B, M, D)
    rows = real.nonzero(as_tuple=True)
    for j in range(steps):
        valid = torch.zeros_like(cand)
        b, i = rows
        ok = inputs[j][1][b, t[b, i]]
        b, i = b[ok], i[ok]
        valid[b, t[b, i]] = True
        yield UnrolledStep(out, valid, b, t[b, i], i * size + j + 1)


def build_dflash(verifier: Any, mask_token_id: int, block_size: int = 8, num_layers: int = 1,
                 aux_layer_ids: Sequence[int] | None = None) -> DFlashNet:
    """A fresh DFlash drafter shaped like `verifier`'s layers."""
    window = getattr(verifier.config, "max_position_embeddings", None)
    return DFlashNet(mask_token_id=mask_token_id, block_size=check_block_size(block_size, window),
                     num_layers=num_layers, aux_layer_ids=aux_layer_ids, **layer_config(verifier))

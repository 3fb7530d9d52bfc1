"""DFlash2 (z-lab's DFlash2; speculators 0.9's `dflash2`, vLLM's `qwen3_dflash2`): DFlash plus two parts that let a
slot see the slots before it.

The backbone is DFlash's (models/dflash.py): one forward over a block [root, K mask tokens] attending the verifier's
fused features of the context. DFlash2 adds
- a local dynamic convolution around each layer's attention and MLP (`GroupedDynamicConv`): a causal convolution
  along the block's rows, `conv_kernel_size` taps, whose per-channel kernel is a learned base plus a per-row delta
  projected from the row itself, one delta per group of `conv_group_size` channels; row k mixes rows k, k-1, ...
  of its own block only (row k reads tap t where k >= t). Initialised as the identity, so a fresh DFlash2 is DFlash.
- a low-rank candidate selector (`CandidateSelector`): the slot's top-K tokens under its unary logits lm_head(h_k)
  are re-scored by unary[c] + <P[x_{k-1}] * W h_k, S[c]>, P and S (V, r) codebooks of the previous and the
  candidate token, W (r x D) a projection of the slot's output; the draft at slot k is the best candidate given the
  token drafted at slot k-1 (the root for slot 1). Trained with a K-way cross-entropy to the verifier's token,
  teacher-forced on the previous target token (train/dflash2.py).

Rows are grouped into blocks of `block_size` (training: every anchor's block), or all rows when fewer (a decode round
that drafts fewer than K): the convolution never crosses a block, as vLLM's position % (1 + speculative tokens).
The layout is vLLM's (`layers.{i}.attention_conv.{base_kernel, kernel_projection.weight}`, `mlp_conv`,
`candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}`, beside DFlash's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.dflash import DFlashLayer, DFlashNet, check_block_size
from models.eagle import layer_config
from runtime.errors import UserError


def check_dflash2(conv_kernel_size: Any, conv_group_size: Any, selector_rank: Any, selector_top_k: Any,
                  hidden_size: int, vocab_size: int, block_size: int,
                  where: str = "model") -> tuple[int, int, int, int]:
    """DFlash2's own settings, each with the fix when it is wrong."""
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not whole(conv_kernel_size) or not 1 <= conv_kernel_size <= block_size:
        raise UserError(f"{where}.conv_kernel_size={conv_kernel_size!r}: the convolution's taps along a block, a "
                        f"whole number from 1 to the block size ({block_size}); speculators trains 2.")
    if not whole(conv_group_size) or conv_group_size < 1 or hidden_size % conv_group_size:
        raise UserError(f"{where}.conv_group_size={conv_group_size!r}: the channels sharing one dynamic kernel must "
                        f"divide the hidden size ({hidden_size}); speculators trains 16.")
    if not whole(selector_rank) or not 1 <= selector_rank < vocab_size:
        raise UserError(f"{where}.selector_rank={selector_rank!r}: the selector's codebooks have rank r with 1 <= r < "
                        f"the vocabulary ({vocab_size}); speculators trains 256.")
    if not whole(selector_top_k) or not 2 <= selector_top_k <= vocab_size:
        raise UserError(f"{where}.selector_top_k={selector_top_k!r}: the candidates re-scored per slot, a whole "
                        f"number from 2 to the vocabulary ({vocab_size}); speculators trains 16.")
    return int(conv_kernel_size), int(conv_group_size), int(selector_rank), int(selector_top_k)


def grouped_conv(x: Tensor, delta: Tensor, base: Tensor, size: int, group: int) -> Tensor:
    """A causal grouped convolution along blocks of `size` rows: out[k] = sum_t (base[t] + delta[k, t]) * x[k - t]
    over taps t <= k's place in its block. x (B, M, D), delta (B, M, taps, D / group), base (taps, D) -> (B, M, D)"""
    bsz, rows, dim = x.shape
    taps, groups = base.shape[0], dim // group
    xs = x.view(bsz, rows, groups, group)
    coef = base.view(1, 1, taps, groups, group).to(x.dtype) + delta.to(x.dtype).unsqueeze(-1)  # (B, M, taps, G, g)
    place = torch.arange(rows, device=x.device) % size
    out = coef[:, :, 0] * xs
    for t in range(1, taps):
        shifted = F.pad(xs[:, :-t], (0, 0, 0, 0, t, 0))  # row k reads row k - t
        out = out + coef[:, :, t] * shifted * (place >= t).view(1, rows, 1, 1).to(x.dtype)
    return out.reshape(bsz, rows, dim)


class GroupedDynamicConv(nn.Module):
    """The input- and output-side convolutions around one sublayer, both kernels' deltas from one projection of the
    sublayer's input (speculators' GroupedDynamicCausalConv, vLLM's DFlashGroupedConv)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        with torch.no_grad():  # the identity: a fresh DFlash2 layer is a DFlash layer
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor, size: int) -> tuple[Tensor, Tensor]:
        """The sublayer's convolved input and the output side's kernel deltas. x (B, M, D)"""
        k = self.kernel_projection(x).view(*x.shape[:2], 2, self.kernel_size, self.num_groups)
        return grouped_conv(x, k[:, :, 0], self.base_kernel[0], size, self.group_size), k[:, :, 1]

    def finish(self, x: Tensor, delta: Tensor, size: int) -> Tensor:
        return grouped_conv(x, delta, self.base_kernel[1], size, self.group_size)


class DFlash2Layer(DFlashLayer):
    """DFlash's layer with a dynamic convolution around its attention and its MLP."""

    def __init__(self, *args: Any, conv_kernel_size: int = 2, conv_group_size: int = 16) -> None:
        super().__init__(*args)
        hidden = self.input_layernorm.weight.shape[0]
        self.attention_conv = GroupedDynamicConv(hidden, conv_kernel_size, conv_group_size)
        self.mlp_conv = GroupedDynamicConv(hidden, conv_kernel_size, conv_group_size)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor, ctx_k: Tensor, ctx_v: Tensor,  # type: ignore[override]
                size: int = 0) -> Tensor:
        size = size or x.shape[1]
        h, delta = self.attention_conv.prepare(self.input_layernorm(x), size)
        out = self.attend(h, positions, mask, ctx_k, ctx_v)
        x = x + self.attention_conv.finish(out, delta, size)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), size)
        return x + self.mlp_conv.finish(self.mlp(h), delta, size)


class CandidateSelector(nn.Module):
    """The low-rank re-scoring of a slot's top-K candidates given the token before the slot (module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for w in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(w, std=0.02)

    def context(self, hidden: Tensor, prev_ids: Tensor) -> Tensor:
        """P[x_{k-1}] * W h_k: (..., D), (...) -> (..., r)"""
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        return self.predecessor_codebook[prev_ids.long()] * proj.to(self.predecessor_codebook.dtype)

    def scores(self, unary: Tensor, hidden: Tensor, prev_ids: Tensor, cand: Tensor) -> Tensor:
        """The candidates' scores unary[c] + <context, S[c]>: unary (N, V), hidden (N, D), prev_ids (N,), cand (N, K)
        -> (N, K). unary may be (1, V) with hidden (1, D) for N parents of one slot (prev_ids (N,), cand (1, K))."""
        ctx = self.context(hidden, prev_ids)  # (N, r)
        succ = self.successor_codebook[cand.long()]  # (N or 1, K, r)
        return unary.gather(-1, cand).float() + (ctx[:, None, :] * succ).sum(-1).float()


class DFlash2Net(DFlashNet):
    """DFlash's drafter with the convolutions and the candidate selector (module docstring)."""

    kind = "dflash2"

    def __init__(self, *args: Any, conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 256,
                 selector_top_k: int = 16, **kw: Any) -> None:
        super().__init__(*args, **kw)
        (self.conv_kernel_size, self.conv_group_size, self.selector_rank,
         self.selector_top_k) = check_dflash2(conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
                                              self.hidden_size, self.vocab_size, self.block_size)
        s = self.shape
        self.layers = nn.ModuleList([
            DFlash2Layer(self.hidden_size, s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"],
                         s["head_dim"], self.rope_theta, self.eps, conv_kernel_size=self.conv_kernel_size,
                         conv_group_size=self.conv_group_size) for _ in range(len(self.layers))])
        self.candidate_selector = CandidateSelector(self.vocab_size, self.hidden_size, self.selector_rank,
                                                    self.selector_top_k)

    def block(self, embeds: Tensor, positions: Tensor, mask: Tensor, ctx_k: Tensor, ctx_v: Tensor) -> Tensor:
        """DFlash's block forward, each layer's convolutions within blocks of block_size rows (all rows when fewer)."""
        x = embeds.to(self.fc.weight.dtype)
        size = min(x.shape[1], self.block_size)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, mask, ctx_k[i], ctx_v[i], size)
        return self.norm(x)

    def candidates(self, unary: Tensor) -> Tensor:
        """The slot's top-K tokens under its unary logits. (..., V) -> (..., K)"""
        return unary.topk(self.selector_top_k, dim=-1).indices

    def rescored(self, unary: Tensor, hidden: Tensor, prev_ids: Tensor) -> Tensor:
        """The draft's logits over the whole vocabulary: the K candidates' selector scores, -inf elsewhere (what the
        drafter ranks and samples from). unary (N or 1, V), hidden (N or 1, D), prev_ids (N,) -> (N, V) fp32"""
        cand = self.candidates(unary)
        scores = self.candidate_selector.scores(unary, hidden, prev_ids, cand)  # (N, K)
        out = torch.full((prev_ids.shape[0], unary.shape[-1]), float("-inf"), device=unary.device)
        return out.scatter_(1, cand.expand(prev_ids.shape[0], -1), scores)


def build_dflash2(verifier: Any, mask_token_id: int, block_size: int = 8, num_layers: int = 1,
                  aux_layer_ids: Sequence[int] | None = None, conv_kernel_size: int = 2, conv_group_size: int = 16,
                  selector_rank: int = 256, selector_top_k: int = 16) -> DFlash2Net:
    """A fresh DFlash2 drafter shaped like `verifier`'s layers; the block must fit the verifier's window."""
    window = getattr(verifier.config, "max_position_embeddings", None)
    return DFlash2Net(mask_token_id=mask_token_id, block_size=check_block_size(block_size, window),
                      num_layers=num_layers, aux_layer_ids=aux_layer_ids, conv_kernel_size=conv_kernel_size,
                      conv_group_size=conv_group_size, selector_rank=selector_rank, selector_top_k=selector_top_k,
                      **layer_config(verifier))

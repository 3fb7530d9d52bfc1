"""The verifier's KV cache during speculative decoding: one forward over [cached prefix + new tokens], then keep
only the accepted path.

We use transformers' `DynamicCache` built without a config, so every layer is a plain `DynamicLayer` holding
`keys`/`values` of shape (B, H_kv, S, Dh) that grow by concatenation. After a tree forward the last N entries of
every layer belong to the N tree nodes; `commit` gathers the accepted nodes into the positions right after the
prefix and drops the rest, which is exactly the cache a plain forward over prefix + accepted tokens would leave.

Tree verification passes the model an explicit 4D mask and explicit position ids. transformers returns a 4D mask
as-is (masking_utils `_preprocess_mask_arguments`) to the attention function, where the eager path *adds* it to
the scores and SDPA takes bool or additive masks; so we build the additive form (0 = visible, dtype-min = hidden),
which both accept. Flash-attention kernels take no custom mask, hence the check below.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from runtime.errors import UserError

CUSTOM_MASK_ATTENTION = ("sdpa", "eager")


@dataclass
class ForwardOutput:
    """Verifier outputs for the tokens just fed: logits (B, T, V) and last-layer hidden states after the final norm,
    i.e. the input of lm_head (B, T, D) -- or, when `forward` was asked for `hidden_layers`, those entries of HF's
    `hidden_states` concatenated on the last dimension (B, T, len(hidden_layers) * D)."""

    logits: Tensor
    hidden: Tensor


def new_cache() -> DynamicCache:
    """An empty cache whose layers are all full-attention `DynamicLayer`s (what `commit` knows how to edit)."""
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def check_model(model: nn.Module, max_length: int, engine: bool = False) -> None:
    """Refuse verifiers whose attention cannot take our tree mask, or whose sliding window would be ignored (on this
    path; `engine`: the decode runs eval.engine.forward, which applies each layer's window itself)."""
    config = model.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in CUSTOM_MASK_ATTENTION:
        raise UserError(
            f"The verifier uses attn_implementation={impl!r}, which takes no custom tree mask. "
            f"Load it with attn_implementation='sdpa' (or 'eager') for speculative decoding."
        )
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in layer_types or (not layer_types and getattr(config, "use_sliding_window", True))
    if sliding and window and max_length > window and not engine:
        raise UserError(
            f"The verifier has a sliding attention window of {window} tokens and this run needs up to {max_length}; "
            f"tree masks here are full attention, so the result would differ from the model. Shorten the prompt or "
            f"max_new_tokens to fit in {window} tokens, or decode through the exact engine (engine=engine) where it "
            f"runs this architecture (eval.engine.arch)."
        )


def _cache_kwarg(model: nn.Module) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name is deprecated until 5.40); 4.x has only
    # the old one, and an unknown keyword would be swallowed by **kwargs and silently ignored.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def tree_attention_bias(tree_mask: Tensor, prefix_len: int, dtype: torch.dtype, batch_size: int = 1) -> Tensor:
    """Additive 4D mask for N new tokens after `prefix_len` cached ones: the prefix is visible to every node, the
    nodes see each other as `tree_mask` (N, N) says. Returns (B, 1, N, prefix_len + N)."""
    n = tree_mask.shape[0]
    bias = torch.zeros(n, prefix_len + n, dtype=dtype, device=tree_mask.device)
    bias[:, prefix_len:].masked_fill_(~tree_mask, torch.finfo(dtype).min)
    return bias[None, None].expand(batch_size, 1, n, prefix_len + n)


@torch.no_grad()
def forward(
    model: nn.Module,
    cache: DynamicCache,
    input_ids: Tensor,
    position_offsets: Tensor | None = None,
    tree_mask: Tensor | None = None,
    hidden_layers: Sequence[int] | None = None,
    last_logits: bool = False,
) -> ForwardOutput:
    """Run the verifier over `input_ids` (B, T) after the cached prefix, appending their keys/values to `cache`.
    `last_logits`: the vocabulary head at the last position only (a prefill's: HF's `logits_to_keep=1`).

    Without `tree_mask` the tokens are a plain continuation (causal, positions prefix_len + 0..T-1): the prefill
    and one-token decoding. With `tree_mask` (T, T) and `position_offsets` (T,) they are tree nodes at positions
    prefix_len + depth, each seeing the prefix, its ancestors and itself.

    `hidden_layers` picks which of HF's `hidden_states` come back (0 = embeddings, i = input of layer i, -1 = after
    the final norm), concatenated (EAGLE-3 reads three layers); None gives the last one alone. Same forward either way.
    """
    bsz, t = input_ids.shape
    prefix_len = cache_length(cache)
    offsets = torch.arange(t, device=input_ids.device) if position_offsets is None else position_offsets
    position_ids = (prefix_len + offsets)[None].expand(bsz, t)  # (B, T)
    attention_mask = None
    if tree_mask is not None:
        dtype = model.get_input_embeddings().weight.dtype
        attention_mask = tree_attention_bias(tree_mask, prefix_len, dtype, bsz)  # (B, 1, T, P+T)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=True,
        **{_cache_kwarg(model): cache},
        **({"logits_to_keep": 1} if last_logits else {}),
    )
    # The last entry of hidden_states is taken after the final norm (the lm_head input) in HF decoders.
    if hidden_layers is None:
        return ForwardOutput(logits=out.logits, hidden=out.hidden_states[-1])
    hidden = torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1)  # (B, T, len(layers) * D)
    return ForwardOutput(logits=out.logits, hidden=hidden)


def commit(cache: DynamicCache, prefix_len: int, keep: Tensor) -> None:
    """Keep the entries of new tokens `keep` (B, A), indices counted from `prefix_len`, in that order, right after
    the prefix; drop every other entry past the prefix. Edits `cache` in place."""
    bsz, a = keep.shape
    contiguous = bool((keep == torch.arange(a, device=keep.device)).all())
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise UserError(
                f"KV cache layer {i} is a {type(layer).__name__}; speculative decoding here edits plain DynamicLayer "
                f"caches only. Build the cache with eval.engine.hf_forward.new_cache()."
            )
        if not layer.is_initialized:
            continue
        if contiguous:  # a chain, or a tree whose accepted path is its first nodes: a crop, no copy
            layer.keys = layer.keys[:, :, : prefix_len + a]
            layer.values = layer.values[:, :, : prefix_len + a]
            continue
        layer.keys = _gather_after(layer.keys, prefix_len, keep)
        layer.values = _gather_after(layer.values, prefix_len, keep)


def _gather_after(x: Tensor, prefix_len: int, keep: Tensor) -> Tensor:
    bsz, heads, _, head_dim = x.shape  # keys and values may differ in head_dim
    index = keep[:, None, :, None].expand(bsz, heads, keep.shape[1], head_dim).to(x.device)  # (B, H, A, Dh)
    return torch.cat([x[:, :, :prefix_len], x[:, :, prefix_len:].gather(2, index)], dim=2)  # (B, H, P+A, Dh)

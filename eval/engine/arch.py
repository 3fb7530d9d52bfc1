"""What differs between the decoder architectures the exact engine runs (eval.engine.forward), read from a Hugging
Face config in one place: q/k norms (Qwen3, Gemma 3), sandwich norms, Gemma's 1 + w RMSNorm, the embedding scale,
the MLP's activation, each layer's sliding window and rotary table, the attention scale and soft-capping, fused
weights (Phi-3). The engine and the drafters read this description; none of them asks for an architecture's name.

`describe(config)` returns an `Arch`, or raises `Unsupported` naming the architecture and what the engine lacks for
it (a mixture of experts, a partial or length-dependent rotary, ...); the decode loops then run Hugging Face's
forward (eval.engine.hf_forward) instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runtime.errors import UserError

# The model types the engine runs, and what each declares beyond a Llama block. Everything else (windows, scales,
# soft-capping, activation, rotary per layer type) is read from the config's own fields.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},  # q/k/v biases: read from the weights
    "qwen3": {"qk_norm": True},
    "phi3": {"fused": True},  # qkv_proj and gate_up_proj hold the fused weights already
    "gemma3_text": {"qk_norm": True, "sandwich": True, "norm_offset": 1.0, "embed_scale": True},
}
_ROPE_TYPES = ("default", "linear", "llama3")  # tables that depend on the position alone (not on the length seen)


class Unsupported(UserError):
    """The engine does not run this architecture; the message names it and what is missing."""


@dataclass(frozen=True)
class Arch:
    """One decoder architecture as the engine runs it.

    model_type: the config's `model_type` (for messages only).
    qk_norm: an RMSNorm over each query and key head (weights `q_norm`, `k_norm`) before rotary.
    sandwich: norms after attention and after the MLP too (`post_attention_layernorm` then applies to attention's
        output and `pre_feedforward_layernorm` / `post_feedforward_layernorm` wrap the MLP), Gemma's layout.
    norm_offset: RMSNorm scales by (norm_offset + w) in fp32 before casting (Gemma: 1.0); 0.0 is Llama's norm,
        which casts to the model dtype first and scales after.
    embed_scale: the embeddings are multiplied by this (in the model dtype; Gemma: sqrt(hidden_size)), or None.
    act: the MLP's activation, a transformers ACT2FN name.
    windows: per layer, the sliding window (a token sees keys at distance < window) or None for full attention.
    rope_kinds: per layer, the rotary table's name (Gemma 3: its layer type, local and global theta) or None for
        the model's single table.
    scale: attention's score scale (head_dim ** -0.5, or query_pre_attn_scalar ** -0.5).
    attn_softcap, final_softcap: tanh soft-capping of attention scores and of the logits, or None.
    fused: q/k/v and gate/up come fused in the checkpoint (`qkv_proj`, `gate_up_proj`).
    """

    model_type: str
    qk_norm: bool
    sandwich: bool
    norm_offset: float
    embed_scale: float | None
    act: str
    windows: tuple[int | None, ...]
    rope_kinds: tuple[str | None, ...]
    scale: float
    attn_softcap: float | None
    final_softcap: float | None
    fused: bool

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.windows)


def _windows(config: Any, layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" and window else None for t in types[:layers])
    on = window and getattr(config, "use_sliding_window", True)
    return tuple(int(window) if on else None for _ in range(layers))


def _rope_kinds(config: Any, layers: int) -> tuple[str | None, ...]:
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    per_type = bool(types) and all(isinstance(params.get(t), dict) for t in set(types))
    tables = [params[t] for t in set(types)] if per_type and types else [params]
    for table in tables:
        kind = table.get("rope_type", "default") if isinstance(table, dict) else "default"
        if kind not in _ROPE_TYPES:
            raise Unsupported(f"model_type={config.model_type!r} uses rope_type={kind!r}, whose rotary table depends "
                              f"on the length seen; the exact engine runs {', '.join(_ROPE_TYPES)}.")
        if isinstance(table, dict) and float(table.get("partial_rotary_factor", 1.0)) != 1.0:
            raise Unsupported(f"model_type={config.model_type!r} rotates part of each head "
                              f"(partial_rotary_factor={table['partial_rotary_factor']}); the exact engine rotates "
                              f"whole heads.")
    return tuple(types[i] if per_type and types else None for i in range(layers))


def describe(config: Any) -> Arch:
    """The description of `config` (a transformers PretrainedConfig), or `Unsupported` naming what is missing."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise Unsupported(
            f"The exact engine (eval.engine.forward) runs {', '.join(sorted(_FAMILIES))}; this verifier is "
            f"model_type={model_type!r}, so it decodes through Hugging Face's forward (eval.engine.hf_forward), exact "
            f"in float32 only."
        )
    family = _FAMILIES[model_type]
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    pre = getattr(config, "query_pre_attn_scalar", None)
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
    return Arch(
        model_type=model_type,
        qk_norm=bool(family.get("qk_norm", False)),
        sandwich=bool(family.get("sandwich", False)),
        norm_offset=float(family.get("norm_offset", 0.0)),
        embed_scale=math.sqrt(config.hidden_size) if family.get("embed_scale") else None,
        act=str(act),
        windows=_windows(config, layers),
        rope_kinds=_rope_kinds(config, layers),
        scale=float(pre) ** -0.5 if pre else head_dim**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        fused=bool(family.get("fused", False)),
    )


def supported(config: Any) -> bool:
    """Whether the exact engine runs this config's architecture."""
    try:
        describe(config)
    except Unsupported:
        return False
    return True


_NOTED: set[str] = set()


def fallback_note(config: Any) -> str | None:
    """Print, once per message, why this config's verifier decodes through Hugging Face's forward (the
    `Unsupported` message, naming the architecture); return it, or None where the engine runs it."""
    try:
        describe(config)
    except Unsupported as e:
        note = str(e)
        if note not in _NOTED:
            _NOTED.add(note)
            print(f"[eval] {note}")
        return note
    return None


SUPPORTED = tuple(_FAMILIES)

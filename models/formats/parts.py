"""What the export formats share, below the registry (models/families.py): the parts and checks of a `speculators`
config (models/exports/speculators.py describes the format) and the keys a reference-layout config does not carry
(models/exports/reference.py). Each family's own layout (models/formats/eagle.py, models/dflash.py, models/medusa.py)
builds on these; models/exports/speculators.py and models/exports/reference.py find the family through the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.errors import UserError

LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_hidden_layers", "rms_norm_eps", "rope_theta", "attention_bias", "hidden_act",
              "vocab_size", "max_position_embeddings", "tie_word_embeddings", "torch_dtype", "dtype")
# What vLLM reads from transformer_layer_config and fills with its own default when absent (the family's reader checks
# the values against the verifier: models.formats.eagle.check_draft_layer).
ENGINE_LAYER_KEYS = ("num_attention_heads", "rope_theta", "rms_norm_eps")
# The parts of a speculators config that are the format's, not the flat config's: a reader drops them.
FORMAT_KEYS = ("speculators_config", "transformer_layer_config", "speculators_model_type", "architectures")


# Keys of this project's exports that a reference config does not carry.
PROJECT_KEYS = ("verifier", "verifier_path", "verifier_fingerprint", "eagle_kind", "verifier_num_hidden_layers",
                "eagle_aux_hidden_state_layer_ids", "dtype", "reference_layout")


def strip_project_keys(config: dict[str, Any]) -> dict[str, Any]:
    """`config` without this project's own keys (PROJECT_KEYS), as a reference config has them."""
    return {k: v for k, v in config.items() if k not in PROJECT_KEYS}


def check_layer_keys(layer: dict[str, Any], file: str) -> None:
    """Refuse a transformer_layer_config without one of ENGINE_LAYER_KEYS: vLLM builds the draft layer from that dict
    alone, so a value found elsewhere in the config is not the one it would use."""
    missing = [k for k in ENGINE_LAYER_KEYS if layer.get(k) is None]
    if missing:
        raise UserError(f"{file}: transformer_layer_config.{missing[0]} is missing: vLLM builds the draft layer from "
                        f"transformer_layer_config and would use its own default. Set it to the verifier's "
                        f"{missing[0]}, or re-export the drafter.")


def check_sections(config: dict[str, Any], file: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transformer_layer_config, speculators_config), each refused when missing, the layer also without a hidden
    size or one of ENGINE_LAYER_KEYS."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict) or "hidden_size" not in layer:
        raise UserError(f"{file}: transformer_layer_config is missing or has no hidden_size: the speculators format "
                        f"needs the drafter layer's Hugging Face config there. Re-export the drafter.")
    check_layer_keys(layer, file)
    spec = config.get("speculators_config")
    if not isinstance(spec, dict):
        raise UserError(f"{file}: speculators_config is missing: it names the algorithm, the proposal methods and the "
                        f"verifier. Re-export the drafter.")
    return layer, spec


def check_proposal(config: dict[str, Any], spec: dict[str, Any], file: str) -> tuple[int, dict[str, Any]]:
    """(speculative tokens, verifier) of a speculators_config, refused when its algorithm contradicts
    speculators_model_type, it drafts no whole number of tokens >= 1 or names no verifier."""
    algo = config.get("speculators_model_type")
    if spec.get("algorithm") != algo:
        raise UserError(f"{file}: speculators_config.algorithm={spec.get('algorithm')!r} contradicts "
                        f"speculators_model_type={algo!r}; set both to {algo!r}.")
    tokens = speculative_tokens(config)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise UserError(f"{file}: speculators_config.proposal_methods has no whole speculative_tokens >= 1 (saw "
                        f"{tokens!r}); vLLM takes the number of drafted tokens from it. Set e.g. "
                        f"\"proposal_methods\": [{{\"proposal_type\": \"greedy\", \"speculative_tokens\": 3}}].")
    verifier = spec.get("verifier")
    if not isinstance(verifier, dict) or not verifier.get("name_or_path"):
        raise UserError(f"{file}: speculators_config.verifier.name_or_path is missing: vLLM loads the verifier from "
                        f"it. Set it to the verifier's local checkpoint directory or Hub id.")
    return tokens, verifier


def speculators_config(algorithm: str, tokens: int, verifier: str, architectures: list[str]) -> dict[str, Any]:
    """The `speculators_config` part: greedy drafting of `tokens` tokens, checked against the verifier vLLM loads from
    `verifier` (a local directory or a Hub id)."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(architectures)}}


def speculative_tokens(config: dict[str, Any]) -> int | None:
    """The number of tokens vLLM drafts per step for a speculators-format config (its default proposal method)."""
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method")
    chosen = next((m for m in methods if isinstance(m, dict) and m.get("proposal_type") == default),
                  methods[0] if methods else None)
    return chosen.get("speculative_tokens") if isinstance(chosen, dict) else None


# -- a config against its weights (the safetensors header's shapes; models.exports.io.check_weights_agree) ---------

Shapes = dict[str, list[int]]  # tensor name -> shape, as the weight file's header lists them


@dataclass(frozen=True)
class Disagreement:
    """A config.json field that disagrees with the weights: the field, its value, the tensor (name and shape, or a
    count of layers or heads) and what the field would make of it."""

    field: str
    value: Any
    tensor: str
    shape: Any
    expected: str


def _int(config: dict[str, Any], key: str) -> int | None:
    """A count the config holds, or None when it holds none (a value of another type or below 1 is left to the
    family's ExportConfig, whose message names the bounds)."""
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def layer_ids(shapes: Shapes) -> dict[int, str]:
    """Layer index -> its tensors' prefix, for a stack written as `layers.{i}.` or as one `midlayer.` (layer 0)."""
    found: dict[int, str] = {}
    for name in shapes:
        if name.startswith("midlayer."):
            found[0] = "midlayer."
        elif name.startswith("layers.") and name.split(".")[1].isdigit():
            found[int(name.split(".")[1])] = f"layers.{name.split('.')[1]}."
    return dict(sorted(found.items()))


def layer_stack_disagreements(config: dict[str, Any], shapes: Shapes,
                              features: tuple[str, Any, int] | None = None) -> list[Disagreement]:
    """The draft layers' config (num_hidden_layers, hidden_size, intermediate_size) against a Llama / Qwen3 stack's
    tensors, and fc's input against `features` = (the config field that sets how many hidden states fc reads, its
    value, that number). Tensors absent (a compact export's) are not checked. The attention heads are left to
    models.formats.eagle.check_draft_layer, which holds them to the verifier's (the weights' own)."""
    out: list[Disagreement] = []
    layers = layer_ids(shapes)
    count = _int(config, "num_hidden_layers")
    if count is not None and layers and count != len(layers):
        prefixes = sorted(set(layers.values()))
        out.append(Disagreement("num_hidden_layers", count, f"{prefixes[0]}*" if len(prefixes) == 1 else
                                f"{{{', '.join(p.rstrip('.') for p in prefixes)}}}.*",
                                f"{len(layers)} layer{'s' if len(layers) > 1 else ''}", f"{count} layers"))
    first = next(iter(layers.values()), None)
    hidden = _int(config, "hidden_size")

    def dim(key: str, value: int | None, tensor: str, axis: int, want: int | None, what: str) -> None:
        shape = shapes.get(tensor)
        if value is not None and want is not None and shape is not None and len(shape) > axis and shape[axis] != want:
            out.append(Disagreement(key, value, tensor, shape, what))

    dim("hidden_size", hidden, "fc.weight", 0, hidden, f"{hidden} output rows")
    dim("hidden_size", hidden, "norm.weight", 0, hidden, f"{hidden} values")
    if first is not None:
        dim("intermediate_size", _int(config, "intermediate_size"), f"{first}mlp.gate_proj.weight", 0,
            _int(config, "intermediate_size"), f"{_int(config, 'intermediate_size')} rows")
    if features is not None and hidden:
        key, value, n = features
        dim(key, value, "fc.weight", 1, n * hidden, f"{n} hidden states x {hidden} = {n * hidden} input columns")
    return out


def draft_vocab_disagreements(config: dict[str, Any], shapes: Shapes) -> list[Disagreement]:
    """draft_vocab_size against the draft head's rows and the draft-to-target map d2t (when the file has them)."""
    draft = _int(config, "draft_vocab_size")
    out = []
    for tensor in ("lm_head.weight", "d2t"):
        shape = shapes.get(tensor)
        if draft is not None and shape and shape[0] != draft:
            out.append(Disagreement("draft_vocab_size", draft, tensor, shape, f"{draft} draft tokens"))
    return out

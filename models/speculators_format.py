"""The `speculators` format: the vLLM project's native drafter config, which `vllm serve EXPORT_DIR` reads as the
model itself (the verifier and the number of speculative tokens come from the export; no --speculative-config).

One config.json with three parts, as vLLM 0.32 reads it (`vllm/transformers_utils/configs/speculators/`):
- `speculators_model_type` (the algorithm vLLM registers: `eagle3` here) and that algorithm's keys
  (`draft_vocab_size`, `norm_before_residual`, ..., `eagle_aux_hidden_state_layer_ids`);
- `transformer_layer_config`: the drafter's own layer, as a Hugging Face config dict;
- `speculators_config`: `algorithm`, `proposal_methods` (`speculative_tokens`, ...), `default_proposal_method`
  and `verifier` (`name_or_path`, `architectures`): vLLM loads the verifier from `name_or_path`, so it must
  resolve where the export is served (a local directory offline, or a Hub id).

This project's own keys (the verifier description and fingerprint, accuracy tables) stay at the top level, where
vLLM keeps them as plain attributes and reads nothing from them. `flatten` turns such a config into the flat one the
rest of the project reads (the layout the older EAGLE-3 exports have), so one reader serves both.
"""

from __future__ import annotations

from typing import Any

from models.errors import UserError
from models.families import FAMILIES


def _families() -> dict[str, str]:
    """speculators_model_type -> the family whose export is written in it (models/families.py)."""
    return {f.export.speculators_type: n for n, f in FAMILIES.items()
            if f.export is not None and f.export.speculators_type is not None}


# The algorithm's flags whose defaults differ between vLLM's reader and the `speculators` library, or whose
# meaning our network fixes: written explicitly, and checked on reading. Our EAGLE-3 layer keeps the un-normed
# hidden state as its residual (vLLM's default for this format would norm it first).
EAGLE3_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
FIXED_FLAGS = ("norm_before_residual", "norm_before_fc")  # our layer computes these one way only
# EAGLE-3.1's options, which our network has either way (models/eagle.py): written from the export, at the top level
# (vLLM's eagle3 reads them there) and in the layer config (its peagle reads them there only).
OPTION_FLAGS = ("fc_norm", "norm_output")
LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_hidden_layers", "rms_norm_eps", "rope_theta", "attention_bias", "hidden_act",
              "vocab_size", "max_position_embeddings", "tie_word_embeddings", "torch_dtype", "dtype")
DEFAULT_SPECULATIVE_TOKENS = 3
# What vLLM reads from transformer_layer_config and fills with its own default when absent (the family's reader checks
# the values against the verifier: models.eagle_export.check_draft_layer).
ENGINE_LAYER_KEYS = ("num_attention_heads", "rope_theta", "rms_norm_eps")


def _check_layer_keys(layer: dict[str, Any], file: str) -> None:
    """Refuse a transformer_layer_config without one of ENGINE_LAYER_KEYS: vLLM builds the draft layer from that dict
    alone, so a value found elsewhere in the config is not the one it would use."""
    missing = [k for k in ENGINE_LAYER_KEYS if layer.get(k) is None]
    if missing:
        raise UserError(f"{file}: transformer_layer_config.{missing[0]} is missing: vLLM builds the draft layer from "
                        f"transformer_layer_config and would use its own default. Set it to the verifier's "
                        f"{missing[0]}, or re-export the drafter.")


def is_speculators(config: dict[str, Any]) -> bool:
    return "speculators_model_type" in config or "speculators_config" in config


def to_speculators(flat: dict[str, Any], algorithm: str, verifier_name_or_path: str,
                   verifier_architectures: list[str],
                   speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> dict[str, Any]:
    """A flat EAGLE-3 export config (models/eagle_export.py's layout plus this project's keys) in the speculators
    format as `algorithm` (the family's `speculators_type`). `speculative_tokens`: the chain length vLLM drafts when
    it serves the export as it is."""
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise UserError(f"speculative_tokens={speculative_tokens!r}: give a whole number >= 1 (the tokens vLLM drafts "
                        f"per step when it serves the export).")
    if algorithm == "dflash":
        return _dflash_to_speculators(flat, verifier_name_or_path, verifier_architectures)
    options = {k: bool(flat.get(k, False)) for k in OPTION_FLAGS}
    layer = {k: flat[k] for k in LAYER_KEYS if k in flat} | options
    layer["architectures"] = ["LlamaForCausalLM"]
    own = {k: v for k, v in flat.items()
           if k not in LAYER_KEYS and k not in ("architectures", "eagle_config", *OPTION_FLAGS)}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": algorithm,
        "transformer_layer_config": layer,
        **EAGLE3_FLAGS,
        **options,
        "draft_vocab_size": flat["draft_vocab_size"],
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(flat["eagle_aux_hidden_state_layer_ids"]),
        "torch_dtype": flat.get("torch_dtype"),
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
        **{k: v for k, v in own.items() if k not in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                                                        "torch_dtype")},
    }


# DFlash's reference layout (models/dflash.py) keeps these in its layer config; the speculators format moves the rest
# to the top level and into `dflash`'s own keys.
DFLASH_LAYER_KEYS = (*LAYER_KEYS, "layer_types", "rope_scaling")


def _speculators_config(algorithm: str, tokens: int, verifier: str, architectures: list[str]) -> dict[str, Any]:
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(architectures)}}


def _dflash_to_speculators(flat: dict[str, Any], verifier: str, architectures: list[str]) -> dict[str, Any]:
    """DFlash's reference-layout config as vLLM's `dflash` speculators type: the layer config (Qwen3, every key written:
    vLLM fills in no defaults), `aux_hidden_state_layer_ids` in vLLM's convention (the input of layer k, which vLLM
    captures as given; it derives the reference layout's ids by subtracting 1), `mask_token_id`, bidirectional
    attention within the block (`sliding_window_non_causal`), and the block's drafts as the speculative tokens."""
    layer = {k: flat[k] for k in DFLASH_LAYER_KEYS if k in flat} | {"architectures": ["Qwen3ForCausalLM"]}
    dconf = flat["dflash_config"]
    own = {k: v for k, v in flat.items()
           if k not in (*DFLASH_LAYER_KEYS, "architectures", "dflash_config", "aux_hidden_state_layer_ids",
                        "block_size")}
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": flat["vocab_size"],
        "target_hidden_size": None,
        "block_size": flat["block_size"],
        "aux_hidden_state_layer_ids": [int(k) + 1 for k in dconf["target_layer_ids"]],
        "mask_token_id": dconf["mask_token_id"],
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "torch_dtype": flat.get("torch_dtype"),
        "speculators_config": _speculators_config("dflash", int(flat["block_size"]) - 1, verifier, architectures),
        **own,
    }


def _dflash_flatten(config: dict[str, Any], file: str) -> dict[str, Any]:
    """vLLM's `dflash` speculators config back as DFlash's reference-layout config (models/dflash.py reads it)."""
    layer = config["transformer_layer_config"]
    _check_layer_keys(layer, file)
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
        if key not in config:
            raise UserError(f"{file}: speculators_model_type='dflash' needs {key}, which is missing: not a DFlash "
                            f"export (another family's, relabelled?). Re-export the drafter, or load it as its own "
                            f"family.")
    if config.get("sliding_window_non_causal") is not True or config.get("sample_from_anchor"):
        raise UserError(f"{file}: sliding_window_non_causal must be true and sample_from_anchor false: this toolkit's "
                        f"DFlash attends both ways within the block and drafts from its mask slots, and vLLM would "
                        f"run another drafter otherwise. Re-export the drafter.")
    tokens = speculative_tokens(config)
    if tokens != int(config["block_size"]) - 1:
        raise UserError(f"{file}: speculative_tokens={tokens!r} but block_size={config['block_size']}: vLLM drafts "
                        f"speculative_tokens from one block of block_size - 1 masks. Set it to "
                        f"{int(config['block_size']) - 1}.")
    flat = {k: v for k, v in config.items()
            if k not in ("speculators_config", "transformer_layer_config", "speculators_model_type", "architectures",
                         "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal",
                         "sample_from_anchor", "draft_vocab_size", "target_hidden_size")}
    flat |= {k: v for k, v in layer.items() if k != "architectures"}
    flat["architectures"] = [FAMILIES["dflash"].export.architectures[0]]
    flat["dflash_config"] = {"mask_token_id": config["mask_token_id"],
                             "target_layer_ids": [int(k) - 1 for k in config["aux_hidden_state_layer_ids"]]}
    flat["speculative_tokens"] = tokens
    flat["speculators_verifier"] = dict(config["speculators_config"].get("verifier") or {})
    return flat


def speculative_tokens(config: dict[str, Any]) -> int | None:
    """The number of tokens vLLM drafts per step for a speculators-format config (its default proposal method)."""
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method")
    chosen = next((m for m in methods if isinstance(m, dict) and m.get("proposal_type") == default),
                  methods[0] if methods else None)
    return chosen.get("speculative_tokens") if isinstance(chosen, dict) else None


def flatten(config: dict[str, Any], file: str = "config.json") -> dict[str, Any]:
    """A speculators-format config as this project's flat EAGLE-3 config, every field vLLM needs checked first:
    one message per problem, naming the key and the fix."""
    algo = config.get("speculators_model_type")
    if algo not in _families():
        raise UserError(f"{file}: speculators_model_type={algo!r}: this toolkit reads the speculators format for "
                        f"{sorted(_families())}. Export the drafter with this toolkit, or convert it "
                        f"with `python -m scripts.convert`.")
    layer = config.get("transformer_layer_config")
    if algo == "dflash" and isinstance(layer, dict) and isinstance(config.get("speculators_config"), dict):
        return _dflash_flatten(config, file)
    if not isinstance(layer, dict) or "hidden_size" not in layer:
        raise UserError(f"{file}: transformer_layer_config is missing or has no hidden_size: the speculators format "
                        f"needs the drafter layer's Hugging Face config there. Re-export the drafter.")
    _check_layer_keys(layer, file)
    spec = config.get("speculators_config")
    if not isinstance(spec, dict):
        raise UserError(f"{file}: speculators_config is missing: it names the algorithm, the proposal methods and the "
                        f"verifier. Re-export the drafter.")
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
    for flag in OPTION_FLAGS:
        if not isinstance(config.get(flag, False), bool):
            raise UserError(f"{file}: {flag}={config[flag]!r}: give true or false (EAGLE-3.1's option).")
    for flag, ours in ((f, EAGLE3_FLAGS[f]) for f in EAGLE3_FLAGS):
        if flag in OPTION_FLAGS:
            continue
        if flag not in config:
            raise UserError(f"{file}: {flag} is not set: vLLM's default for the speculators format and the "
                            f"speculators library's differ, so the export must say it. This toolkit's EAGLE-3 "
                            f"layer needs {flag}={str(ours).lower()}.")
        if bool(config[flag]) != ours:
            raise UserError(f"{file}: {flag}={config[flag]!r}, but this toolkit's EAGLE-3 layer computes "
                            f"{flag}={ours}; the drafter would run another network in vLLM than the one trained. "
                            f"Set {flag} to {str(ours).lower()} (or re-export the drafter).")
    flat = {k: v for k, v in config.items()
            if k not in ("speculators_config", "transformer_layer_config", "speculators_model_type", "architectures",
                         *FIXED_FLAGS, "target_hidden_size")}
    flat |= {k: v for k, v in layer.items() if k != "architectures" and k not in OPTION_FLAGS}
    if algo == "peagle":  # vLLM's peagle reads EAGLE-3.1's options in the layer config only
        flat |= {k: bool(layer.get(k, False)) for k in OPTION_FLAGS}
    flat["architectures"] = [FAMILIES[_families()[algo]].export.architectures[0]]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:  # the older flat layout's SGLang key (output of layer k - 1): what to_reference writes
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids], "use_aux_hidden_state": True}
    flat["eagle_kind"] = _families()[algo]
    flat["speculative_tokens"] = tokens
    flat["speculators_verifier"] = dict(verifier)
    return flat

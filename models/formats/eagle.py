"""The EAGLE-1 and EAGLE-3 export layouts (models/families.py registers them; models/exports/io.py does the files).

Both are the Llama-drafter layouts vLLM and SGLang load: a Llama config for one decoder layer (`architectures`
names the family), `fc.weight`, `layers.0.*` (EAGLE-1) or `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d` (EAGLE-3).
EAGLE-3's feature layers are written twice, once per engine's convention (`aux_layer_ids`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.eagle import Eagle1Net, Eagle3Net, EagleNet, check_aux_layers, layer_config
from models.formats import parts
from models.formats.config import ExportConfig
from runtime.errors import UserError
from runtime.io import load_state

SERVING_DTYPES = ("bfloat16", "float16")


def serving_dtype(verifier: Any) -> str:
    """The dtype the drafter is served in: the verifier's own when it is a serving dtype, else bfloat16 (SGLang with
    --dtype auto would turn a declared float32 into float16 beside a bf16 target)."""
    declared = str(getattr(verifier.config, "dtype", None) or getattr(verifier.config, "torch_dtype", None) or "")
    declared = declared.replace("torch.", "")
    return declared if declared in SERVING_DTYPES else "bfloat16"


def draft_layer_config(verifier: Any, model_type: str, num_layers: int) -> dict[str, Any]:
    """The Hugging Face config keys of `num_layers` draft layers shaped like the verifier's (what an engine builds the
    drafter's layers from): EAGLE's one Llama layer, DFlash's Qwen3 ones."""
    lc = layer_config(verifier)
    dtype = serving_dtype(verifier)
    return {
        "model_type": model_type,
        "hidden_size": lc["hidden_size"],
        "intermediate_size": lc["intermediate_size"],
        "num_attention_heads": lc["num_attention_heads"],
        "num_key_value_heads": lc["num_key_value_heads"],
        "head_dim": lc["head_dim"],
        "num_hidden_layers": num_layers,
        "rms_norm_eps": lc["rms_norm_eps"],
        "rope_theta": lc["rope_theta"],
        "attention_bias": lc["attention_bias"],
        "hidden_act": "silu",
        "vocab_size": lc["vocab_size"],
        "max_position_embeddings": int(getattr(verifier.config, "max_position_embeddings", 2048)),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


# The draft layer's settings an engine reads from the export (not from the verifier) and this toolkit's layer takes from
# the verifier: each must be in an export this toolkit wrote, and equal to the verifier's.
ENGINE_LAYER_KEYS = ("num_attention_heads", "rope_theta", "rms_norm_eps")


def check_draft_layer(config: dict[str, Any], verifier: Any, where: str | Path, required: bool = True) -> None:
    """Refuse an export config whose draft-layer settings an engine would read otherwise than this toolkit runs the
    layer (which copies them from the verifier: draft_layer_config): ENGINE_LAYER_KEYS missing (when `required`, i.e.
    an export this toolkit wrote) or other than the verifier's, a head count or head size other than the verifier's.
    One message each, naming the field, the value seen, the value expected and the fix. A reference-layout checkpoint
    (`required` False: it names no verifier, and its layer is rebuilt from the one given) is warned about instead."""
    lc = layer_config(verifier)
    fix = ("Re-export the drafter (python -m scripts.tools.convert from-reference <this folder> <new folder>), or pass "
           "the verifier it was trained on")
    missing = [k for k in ENGINE_LAYER_KEYS if config.get(k) is None]
    if required and missing:
        raise UserError(f"{where}: {missing[0]} is missing (expected {lc[missing[0]]!r}, the verifier's): an engine "
                        f"would build the draft layer with its own default. {fix}.")

    def refuse(key: str, seen: Any, expected: Any, why: str) -> None:
        message = f"{where}: {key}={seen!r} but the verifier's is {expected!r}: {why}"
        if not required:
            warnings.warn(f"{message}. This toolkit reads the reference checkpoint with the verifier's value (and "
                          f"writes it when converting); check that it is the verifier the drafter was trained on.",
                          stacklevel=4)
            return
        raise UserError(f"{message}. {fix}.")

    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        seen = config.get(key)
        if seen is not None and (isinstance(seen, bool) or not isinstance(seen, int) or seen != lc[key]):
            refuse(key, seen, lc[key], "an engine would split the draft layer's attention otherwise than it was "
                                       "trained")
    for key in ("rope_theta", "rms_norm_eps"):  # the layer copies the verifier's
        seen = config.get(key)
        if seen is not None and (isinstance(seen, bool) or not isinstance(seen, (int, float))
                                 or not math.isclose(float(seen), lc[key], rel_tol=1e-6)):
            refuse(key, seen, lc[key], "this toolkit runs the draft layer with the verifier's value and an engine "
                                       "with the export's, so the two would draft differently")
    heads, size = config.get("num_attention_heads"), config.get("hidden_size", lc["hidden_size"])
    if config.get("head_dim") is None and isinstance(heads, int) and heads > 0 and isinstance(size, int):
        if size // heads != lc["head_dim"]:
            refuse("head_dim", f"hidden_size / num_attention_heads = {size}/{heads}", lc["head_dim"],
                   "with no head_dim an engine takes hidden_size // num_attention_heads; set head_dim")


@dataclass(frozen=True, kw_only=True)
class EagleConfig(ExportConfig):
    """An EAGLE-1 export's own config.json keys (its draft layer's shape beside them is the verifier's:
    draft_layer_config, checked by check_draft_layer)."""

    eagle_kind: str | None = field(default=None, metadata={"help": "the family the export holds"})
    verifier_num_hidden_layers: int | None = field(default=None, metadata={"help": "the verifier's layer count",
                                                                           "min": 1})


@dataclass(frozen=True, kw_only=True)
class SGLangAuxLayers(ExportConfig):
    """EAGLE-3's `eagle_config` object, which SGLang reads."""

    eagle_aux_hidden_state_layer_ids: list[int] | None = field(default=None, metadata={
        "help": "the verifier layers the drafter reads, in SGLang's convention (id k = output of layer k)",
        "min": -1})
    use_aux_hidden_state: bool = field(default=True, metadata={"help": "whether the drafter reads them (it does)"})


@dataclass(frozen=True, kw_only=True)
class Eagle3Config(EagleConfig):
    """An EAGLE-3 export's own config.json keys: EAGLE-1's and its feature layers, draft vocabulary and options."""

    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "the tokens the drafter's head scores (null: the verifier's vocabulary)", "min": 1})
    eagle_aux_hidden_state_layer_ids: list[int] | None = field(default=None, metadata={
        "help": "the verifier layers the drafter reads, in vLLM's convention (id k = input of layer k)", "min": 0})
    eagle_config: SGLangAuxLayers | None = field(default=None, metadata={"help": "the same layers, for SGLang"})
    fc_norm: bool = field(default=False, metadata={"help": "EAGLE-3.1's option: a norm on each feature before fc"})
    norm_output: bool = field(default=False, metadata={"help": "EAGLE-3.1's option: the final norm's output fed "
                                                               "back as the next step's feature"})


def eagle3_keys(net: Eagle3Net, verifier: Any) -> dict[str, Any]:
    """Eagle3Config's fields of `net` (and PEagleConfig's, for a P-EAGLE network)."""
    lc = layer_config(verifier)
    ids = list(net.aux_layer_ids)
    check_aux_layers(ids, lc["num_verifier_layers"])
    # vLLM (both model runners) reads the top-level key, as the input of layer k (this project's convention);
    # SGLang reads only the nested one, as the output of layer k (it adds 1): the same layers, written twice.
    return dict(eagle_kind=net.kind, verifier_num_hidden_layers=lc["num_verifier_layers"],
                draft_vocab_size=net.draft_vocab_size, eagle_aux_hidden_state_layer_ids=ids,
                eagle_config=SGLangAuxLayers(eagle_aux_hidden_state_layer_ids=[k - 1 for k in ids]),
                fc_norm=net.fc_norm is not None, norm_output=net.norm_output)


def eagle_layout(net: EagleNet, verifier: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The config keys (the draft layer's, then EagleConfig's or Eagle3Config's; `architectures` comes from the
    registry) and tensors of an EAGLE-1 or EAGLE-3 export."""
    lc = layer_config(verifier)
    tensors = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    if isinstance(net, Eagle3Net):
        own: EagleConfig = Eagle3Config(**eagle3_keys(net, verifier))
    else:
        own = EagleConfig(eagle_kind=net.kind, verifier_num_hidden_layers=lc["num_verifier_layers"])
        if "fc.bias" not in tensors:
            # SGLang and the EAGLE repository build fc with a bias and would leave a missing one random; vLLM drops
            # an unexpected `.bias` (harmless: it is zero). Not `"bias": true` in the config: engines read that as
            # "attention has biases".
            tensors["fc.bias"] = torch.zeros(net.hidden_size, dtype=net.fc.weight.dtype)
    return draft_layer_config(verifier, "llama", 1) | own.to_config(), tensors


def aux_layer_ids(config: dict[str, Any], num_layers: int, file: str | Path = "config.json",
                  required: bool = False) -> list[int]:
    """An EAGLE-3 export's feature layers in this project's convention (id k = input of layer k = HF
    `hidden_states[k]`), refusing ids that an engine would read differently.

    The top-level `eagle_aux_hidden_state_layer_ids` is this convention (vLLM reads it); `eagle_config.
    eagle_aux_hidden_state_layer_ids` must then be each id minus 1 (SGLang adds 1). An older export with only the
    nested key stored this convention there; none at all = the engines' default [2, L//2, L-3], refused when
    `required` (an export this toolkit wrote always records the layers it was trained on)."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is not None:
        check_aux_layers(top, num_layers, f"{file}: eagle_aux_hidden_state_layer_ids")
        if nested is not None and list(nested) != [k - 1 for k in top]:
            raise UserError(f"{file}: eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} is not "
                            f"eagle_aux_hidden_state_layer_ids - 1 = {[k - 1 for k in top]}: SGLang reads the nested "
                            f"key as 'output of layer k' and vLLM the top-level one as 'input of layer k', so the two "
                            f"engines would feed different layers. Set the nested key to {[k - 1 for k in top]}.")
        return list(top)
    if nested is not None:
        check_aux_layers(nested, num_layers, f"{file}: eagle_config.eagle_aux_hidden_state_layer_ids")
        return list(nested)
    default = [2, num_layers // 2, num_layers - 3]
    if required:
        raise UserError(f"{file}: eagle_aux_hidden_state_layer_ids is missing: vLLM would feed the drafter its default "
                        f"layers {default}, not necessarily the ones it was trained on. Set it to the ids the drafter "
                        f"was trained with (the run's model.aux_layer_ids), or re-export the drafter.")
    check_aux_layers(default, num_layers, f"{file}: no eagle_aux_hidden_state_layer_ids, so the engines' default")
    return default


def check_draft_vocab(tensors: dict[str, Tensor], draft: int, vocab: int, file: Path) -> None:
    """Check EAGLE-3's d2t / t2d against the verifier's vocabulary, derive a missing t2d, in place."""
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if draft == vocab:
        if d2t is not None and bool(d2t.any()):
            raise UserError(f"{file}: d2t is not all zeros but draft_vocab_size = the vocabulary size ({draft}): a "
                            f"full-vocabulary draft maps ids to themselves. Re-export the checkpoint.")
        return
    if d2t is None:
        raise UserError(f"{file}: no d2t tensor, but draft_vocab_size={draft} is smaller than the verifier's "
                        f"vocabulary ({vocab}): the draft ids cannot be mapped.")
    if t2d is None and d2t.numel() == draft:
        target = d2t.long() + torch.arange(d2t.numel())
        if int(target.max()) < vocab:
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[target] = True
    if (t2d is None or t2d.numel() != vocab or d2t.numel() != draft
            or int((d2t + d2t.new_tensor(range(d2t.numel()))).max()) >= vocab):
        raise UserError(f"{file}: the draft vocabulary (d2t/t2d) does not fit the verifier's vocabulary of {vocab} "
                        f"tokens. Retrain the drafter for this verifier.")
    tensors |= {"d2t": d2t.long(), "t2d": t2d.bool()}


def eagle_from_layout(kind: str, config: dict[str, Any], tensors: dict[str, Tensor], verifier: Any, file: Path,
                      reference: bool) -> tuple[EagleNet, None]:
    """The EAGLE-1 (`kind` "eagle") or EAGLE-3 ("eagle3") network an export holds, shaped like `verifier`'s layers."""
    lc = layer_config(verifier)
    if kind != "eagle3":
        EagleConfig.from_config(config, file.parent / "config.json")
    fc = tensors.get("fc.weight")
    if fc is None:
        raise UserError(f"{file}: no fc.weight tensor; this is not an EAGLE export. Re-export the checkpoint.")
    if "hidden_size" in config and int(fc.shape[0]) != int(config["hidden_size"]):
        raise UserError(f"{file}: config.json hidden_size={config['hidden_size']} but fc.weight is {tuple(fc.shape)} "
                        f"(hidden size {fc.shape[0]}). Re-export the checkpoint, or fix hidden_size.")
    if int(fc.shape[0]) != lc["hidden_size"]:
        raise UserError(f"{file}: fc.weight {tuple(fc.shape)} is for a hidden size of {fc.shape[0]}, but the "
                        f"verifier's hidden_size is {lc['hidden_size']}. Pass the verifier the drafter was trained on.")
    check_draft_layer(config, verifier, file.parent / "config.json", required=not reference)
    if kind == "eagle3":
        own = Eagle3Config.from_config(config, file.parent / "config.json")
        aux = aux_layer_ids(config, lc["num_verifier_layers"], file.parent / "config.json", required=not reference)
        draft = min(own.draft_vocab_size or lc["vocab_size"], lc["vocab_size"])
        check_draft_vocab(tensors, draft, lc["vocab_size"], file)
        net: EagleNet = Eagle3Net(draft_vocab_size=draft, aux_layer_ids=aux, fc_norm=own.fc_norm,
                                  norm_output=own.norm_output, **lc)
    else:
        bias = tensors.get("fc.bias")
        if bias is not None and not bool(bias.any()):
            tensors.pop("fc.bias")  # the zero bias the export writes for SGLang and the EAGLE repository
        net = Eagle1Net(fc_bias="fc.bias" in tensors, **lc)
    load_state(net, tensors, file)
    return net, None


# -- the speculators format (models/exports/speculators.py): vLLM's eagle3 and peagle ----------------------------------

# The algorithm's flags whose defaults differ between vLLM's reader and the `speculators` library, or whose
# meaning our network fixes: written explicitly, and checked on reading. Our EAGLE-3 layer keeps the un-normed
# hidden state as its residual (vLLM's default for this format would norm it first).
EAGLE3_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
FIXED_FLAGS = ("norm_before_residual", "norm_before_fc")  # our layer computes these one way only
# EAGLE-3.1's options, which our network has either way (models/eagle.py): written from the export, at the top level
# (vLLM's eagle3 reads them there) and in the layer config (its peagle reads them there only).
OPTION_FLAGS = ("fc_norm", "norm_output")


def eagle3_to_speculators(flat: dict[str, Any], algorithm: str, verifier_name_or_path: str,
                          verifier_architectures: list[str], speculative_tokens: int) -> dict[str, Any]:
    """A flat EAGLE-3 (or P-EAGLE) export config in the speculators format as `algorithm` (`eagle3`, `peagle`)."""
    options = {k: bool(flat.get(k, False)) for k in OPTION_FLAGS}
    layer = {k: flat[k] for k in parts.LAYER_KEYS if k in flat} | options
    layer["architectures"] = ["LlamaForCausalLM"]
    aux = len(flat["eagle_aux_hidden_state_layer_ids"])
    if aux != vllm_aux_count({}):  # vLLM sizes fc from this key (vllm_aux_count), not from the ids
        layer["num_aux_hidden_states"] = aux
    own = {k: v for k, v in flat.items() if k not in parts.LAYER_KEYS
           and k not in ("architectures", "eagle_config", "num_aux_hidden_states", *OPTION_FLAGS)}
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
        "speculators_config": parts.speculators_config(algorithm, speculative_tokens, verifier_name_or_path,
                                                      verifier_architectures),
        **{k: v for k, v in own.items() if k not in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                                                        "torch_dtype")},
    }


def eagle_from_speculators(config: dict[str, Any], file: str, name: str, architecture: str,
                      options_in_layer: bool, own: type[Eagle3Config]) -> dict[str, Any]:
    """The flat config of an EAGLE-3-style speculators config: the format's parts and the family's keys (`own`)
    checked, the layer config moved to the top level, the fixed flags dropped."""
    layer, section = parts.check_sections(config, file)
    tokens, verifier = parts.check_proposal(config, section, file)
    own.from_config(config, file)  # the family's keys, at the top level as the flat config has them
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
    flat = {k: v for k, v in config.items() if k not in (*parts.FORMAT_KEYS, *FIXED_FLAGS, "target_hidden_size")}
    flat |= {k: v for k, v in layer.items() if k != "architectures" and k not in OPTION_FLAGS}
    if options_in_layer:
        flat |= {k: bool(layer.get(k, False)) for k in OPTION_FLAGS}
    flat["architectures"] = [architecture]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:  # the older flat layout's SGLang key (output of layer k - 1): what to_reference writes
        flat["eagle_config"] = SGLangAuxLayers(eagle_aux_hidden_state_layer_ids=[k - 1 for k in ids]).to_config()
    flat["eagle_kind"] = name
    flat["speculative_tokens"] = tokens
    flat["speculators_verifier"] = dict(verifier)
    return flat


def eagle3_from_speculators(config: dict[str, Any], file: str, name: str, architecture: str) -> dict[str, Any]:
    """vLLM's `eagle3` speculators config as the flat EAGLE-3 config (`name`'s, written as `architecture`)."""
    return eagle_from_speculators(config, file, name, architecture, options_in_layer=False, own=Eagle3Config)


# -- the reference layouts (models/exports/reference.py): the EAGLE repository's EAGLE-1, SpecForge's EAGLE-3 --------

def is_eagle1_reference(config: dict[str, Any], names: list[str]) -> bool:
    """The EAGLE repository's EAGLE-1 weights: `fc.weight` and one decoder layer `layers.0.*` (no EAGLE-3 midlayer)."""
    return ("fc.weight" in names and any(n.startswith("layers.0.") for n in names)
            and not is_eagle3_reference(config, names))


def is_eagle3_reference(config: dict[str, Any], names: list[str]) -> bool:
    """SpecForge's / the EAGLE repository's EAGLE-3 weights: a `midlayer.*`."""
    return any(n.startswith("midlayer.") for n in names)


def _from_reference(kind: str, config: dict[str, Any], tensors: dict[str, Tensor]) -> tuple[dict, dict]:
    cfg = dict(config) | {"eagle_kind": kind, "reference_layout": kind}
    out = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "model.embed_tokens.weight")}
    return cfg, out


def eagle1_from_reference(config: dict[str, Any], tensors: dict[str, Tensor],
                          file: Path | None = None) -> tuple[dict, dict]:
    """An EAGLE-1 reference config + state dict -> this project's (same tensor names; embeddings dropped)."""
    return _from_reference("eagle", config, tensors)


def eagle3_from_reference(config: dict[str, Any], tensors: dict[str, Tensor],
                          file: Path | None = None) -> tuple[dict, dict]:
    """An EAGLE-3 reference config + state dict -> this project's (embeddings dropped; the layer ids moved from
    SGLang's convention, nested, to this project's, top-level)."""
    cfg, out = _from_reference("eagle3", config, tensors)
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = [int(k) + 1 for k in ids]
    return cfg, out


def eagle1_to_reference(config: dict[str, Any], tensors: dict[str, Tensor], base_model: str | None = None,
                        file: Path | None = None) -> tuple[dict, dict]:
    """This project's EAGLE-1 export -> the EAGLE repository's config + state dict (fc always with a bias)."""
    cfg = parts.strip_project_keys(config)
    out = dict(tensors)
    out.setdefault("fc.bias", torch.zeros(int(config["hidden_size"]), dtype=out["fc.weight"].dtype))
    cfg["architectures"] = ["LlamaForCausalLM"]  # ea_model.py: the draft config's architectures is not read
    return cfg, out


def eagle3_to_reference(config: dict[str, Any], tensors: dict[str, Tensor], base_model: str | None = None,
                        file: Path | None = None) -> tuple[dict, dict]:
    """This project's EAGLE-3 export -> SpecForge's config + state dict (d2t / t2d always written)."""
    cfg = parts.strip_project_keys(config)
    out = dict(tensors)
    vocab, draft = int(config["vocab_size"]), int(config.get("draft_vocab_size") or config["vocab_size"])
    if "d2t" not in out:  # SpecForge writes d2t / t2d always, full vocabulary included
        out["d2t"] = torch.zeros(draft, dtype=torch.long)
        out["t2d"] = torch.arange(vocab) < draft
    cfg["draft_vocab_size"] = draft
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    return cfg, out


# -- the config against its weights (models.exports.io.check_weights_agree), as this toolkit and as vLLM read it ---

def eagle1_weights_agree(config: dict[str, Any], shapes: parts.Shapes) -> list[parts.Disagreement]:
    """An EAGLE-1 export's draft layer against its tensors; fc reads two hidden states (the token's and the feature)."""
    return parts.layer_stack_disagreements(config, shapes, ("hidden_size", config.get("hidden_size"), 2))


def eagle3_weights_agree(config: dict[str, Any], shapes: parts.Shapes) -> list[parts.Disagreement]:
    """An EAGLE-3 (or P-EAGLE) export's draft layer, feature layers and draft vocabulary against its tensors."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    features = ("eagle_aux_hidden_state_layer_ids", ids, len(ids)) if isinstance(ids, list) and ids else None
    return parts.layer_stack_disagreements(config, shapes, features) + parts.draft_vocab_disagreements(config, shapes)


def vllm_aux_count(layer: dict[str, Any]) -> int:
    """The feature layers vLLM's EAGLE-3 drafter sizes fc for (models/llama_eagle3.py `LlamaModel.__init__`):
    transformer_layer_config's num_aux_hidden_states, else its eagle_config ids' count, else 3. The top-level ids,
    which the runners capture, do not size fc."""
    ids = (layer.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return int(layer.get("num_aux_hidden_states") or (len(ids) if ids else 3))


def eagle3_engine_disagreements(config: dict[str, Any], shapes: parts.Shapes) -> list[parts.Disagreement]:
    """What vLLM's `eagle3` / `peagle` reader would build from a speculators config (docs/engine_loaders.md) against
    the tensors it would load: fc's width, and the draft-to-target maps for the draft vocabulary it takes."""
    layer = config.get("transformer_layer_config") or {}
    out = []
    n = vllm_aux_count(layer)
    target = config.get("target_hidden_size") or layer.get("hidden_size")
    fc = shapes.get("fc.weight")
    if fc and isinstance(target, int) and fc[1] != n * target:
        out.append(parts.Disagreement("transformer_layer_config.num_aux_hidden_states",
                                      layer.get("num_aux_hidden_states"), "fc.weight", fc,
                                      f"vLLM sizes fc for {n} hidden states x {target} = {n * target} columns"))
    vocab = layer.get("vocab_size")
    draft = config.get("draft_vocab_size") or vocab
    if draft == vocab and "d2t" in shapes:
        out.append(parts.Disagreement("draft_vocab_size", draft, "d2t", shapes["d2t"], "no d2t: vLLM builds no "
                                      "draft-to-target map for a full vocabulary and refuses the tensor"))
    if draft != vocab and shapes.get("d2t", [None])[0] != draft:
        out.append(parts.Disagreement("draft_vocab_size", draft, "d2t", shapes.get("d2t", "missing"),
                                      f"{draft} entries (without it vLLM maps draft ids to themselves)"))
    if isinstance(vocab, int) and "t2d" in shapes and shapes["t2d"][0] != vocab:
        out.append(parts.Disagreement("transformer_layer_config.vocab_size", vocab, "t2d", shapes["t2d"],
                                      f"{vocab} entries, one per verifier token"))
    return out

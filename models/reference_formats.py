"""The public reference layouts, read into and written from this project's export layout (docs/engine_loaders.md,
"Reference layouts"). Pure functions over (config dict, tensor dict); models/export.py does the file I/O.

- `medusa`: FasterDecoding/Medusa: `config.json` {medusa_num_heads, medusa_num_layers, base_model_name_or_path} +
  `medusa_lm_head.safetensors` or `.pt`; keys `{h}.{l}.linear.weight|bias`, `{h}.{L}.weight` (the Medusa-2 file
  has no `{h}.{L}.weight`: the base model's lm_head is shared). Only medusa_num_layers = 1 maps (the reference's
  `[ResBlock] * L` is one block repeated).
- `eagle`: SafeAILab/EAGLE EAGLE-1: Llama config + `pytorch_model.bin` / `model.safetensors` with `fc.weight`,
  `fc.bias`, `layers.0.*` (maybe `embed_tokens.weight`, dropped: the verifier's is used).
- `eagle3`: SpecForge / EAGLE repository EAGLE-3: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`; layer ids,
  if any, in `eagle_config.eagle_aux_hidden_state_layer_ids` in SGLang's convention (id k = output of layer k, i.e.
  this project's k + 1); none = the engines' default [2, L//2, L-3] in this project's convention.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.errors import UserError

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
EAGLE_FILES = ("model.safetensors", "pytorch_model.bin")
# Keys of this project's exports that a reference config does not carry.
PROJECT_KEYS = ("verifier", "verifier_path", "verifier_fingerprint", "eagle_kind", "verifier_num_hidden_layers",
                "eagle_aux_hidden_state_layer_ids", "dtype", "reference_layout")
_MEDUSA_KEY = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


def layout_of(config: dict[str, Any], names: list[str]) -> str | None:
    """`medusa`, `eagle` or `eagle3` for a reference layout read from `config` and the weight file's tensor names
    (`names`, empty for a Medusa file, found by its file name); None if it is none of them."""
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle"
    if any(_MEDUSA_KEY.match(n) for n in names) or "medusa_num_heads" in config:
        return "medusa"
    return None


def _strip(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in PROJECT_KEYS}


# -- reference -> project ---------------------------------------------------------------------------------------------

def medusa_from_reference(config: dict[str, Any], tensors: dict[str, Tensor], file: Path) -> tuple[dict, dict]:
    """A Medusa reference config + state dict -> this project's Medusa config + tensors (vLLM's names)."""
    layers = int(config.get("medusa_num_layers", 1))
    if layers != 1:
        raise UserError(f"{file.parent / 'config.json'}: medusa_num_layers={layers}; only 1 maps (the reference "
                        f"repeats one shared ResBlock {layers} times, which this project's heads cannot express). "
                        f"Retrain with model.num_layers=1 or convert a 1-layer checkpoint.")
    parsed: dict[tuple[int, int, str], Tensor] = {}
    for name, t in tensors.items():
        m = _MEDUSA_KEY.match(name)
        if m is None:
            raise UserError(f"{file}: tensor {name!r} is not a Medusa reference key ({{h}}.{{l}}.linear.weight|bias "
                            f"or {{h}}.{{L}}.weight).")
        parsed[(int(m[1]), int(m[2]), m[3])] = t
    heads = sorted({h for h, _, _ in parsed})
    if heads != list(range(len(heads))) or not heads:
        raise UserError(f"{file}: the heads in the file are {heads}; expected 0..K-1.")
    declared = config.get("medusa_num_heads")
    if declared is not None and int(declared) != len(heads):
        raise UserError(f"{file}: config.json medusa_num_heads={declared} but the file holds {len(heads)} heads "
                        f"(keys 0..{len(heads) - 1}.*). Fix medusa_num_heads in {file.parent / 'config.json'}.")
    hidden = int(parsed[(0, 0, "weight")].shape[0]) if (0, 0, "weight") in parsed else None
    if hidden is None:
        raise UserError(f"{file}: no 0.0.linear.weight, so this is not a 1-layer Medusa reference file.")
    if config.get("hidden_size") is not None and int(config["hidden_size"]) != hidden:
        raise UserError(f"{file}: 0.0.linear.weight is ({hidden}, {hidden}) but config.json hidden_size="
                        f"{config['hidden_size']}.")
    own = [(h, 1, "weight") in parsed for h in heads]
    if any(own) and not all(own):
        raise UserError(f"{file}: only some heads have a vocabulary projection ({{h}}.1.weight); expected all or none.")
    out: dict[str, Tensor] = {}
    for h in heads:
        for part in ("weight", "bias"):
            if (h, 0, part) not in parsed:
                raise UserError(f"{file}: {h}.0.linear.{part} is missing.")
            out[f"blocks.{h}.layers.0.{part}"] = parsed[(h, 0, part)]
        if all(own):
            out[f"lm_heads.{h}.weight"] = parsed[(h, 1, "weight")]
    vocab = int(parsed[(0, 1, "weight")].shape[0]) if all(own) else config.get("vocab_size")
    cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": len(heads), "num_hidden_layers": 1,
           "hidden_size": hidden, "vocab_size": vocab, "truncated_vocab_size": vocab, "medusa_fc_bias": True,
           "original_lm_head": not all(own), "reference_layout": "medusa"}
    if config.get("base_model_name_or_path"):
        cfg["verifier_path"] = config["base_model_name_or_path"]
    return cfg, out


def eagle_from_reference(kind: str, config: dict[str, Any], tensors: dict[str, Tensor],
                         file: Path | None = None) -> tuple[dict, dict]:
    """An EAGLE-1 / EAGLE-3 reference config + state dict -> this project's (same tensor names; embeddings dropped;
    EAGLE-3 layer ids moved to this project's convention, top-level)."""
    cfg = dict(config) | {"eagle_kind": kind, "reference_layout": kind}
    out = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "model.embed_tokens.weight")}
    if kind == "eagle3":
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = [int(k) + 1 for k in ids]
    return cfg, out


# -- project -> reference ---------------------------------------------------------------------------------------------

def medusa_to_reference(config: dict[str, Any], tensors: dict[str, Tensor], base_model: str | None,
                        file: Path) -> tuple[dict, dict]:
    """This project's Medusa export -> the reference config + state dict (`{h}.0.linear.*`, `{h}.1.weight`)."""
    layers = int(config["num_hidden_layers"])
    if layers != 1:
        raise UserError(f"{file.parent / 'config.json'}: num_hidden_layers={layers}; the Medusa reference shares one "
                        f"ResBlock across its layers, so only 1-layer heads convert. Retrain with model.num_layers=1.")
    heads = int(config["num_heads"])
    out: dict[str, Tensor] = {}
    for h in range(heads):
        out[f"{h}.0.linear.weight"] = tensors[f"blocks.{h}.layers.0.weight"]
        out[f"{h}.0.linear.bias"] = tensors[f"blocks.{h}.layers.0.bias"]
        proj = tensors.get("lm_head.weight") if config.get("original_lm_head") else tensors.get(f"lm_heads.{h}.weight")
        if proj is None:
            raise UserError(f"{file}: no vocabulary projection for head {h} (lm_head.weight with original_lm_head, "
                            f"else lm_heads.{h}.weight); re-export it with train.py.")
        out[f"{h}.1.weight"] = proj.clone()  # one tensor per head: the reference has no shared head
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": 1, "base_model_name_or_path": base_model,
           "hidden_size": int(config["hidden_size"]), "vocab_size": int(config["vocab_size"])}
    return cfg, out


def eagle_to_reference(kind: str, config: dict[str, Any], tensors: dict[str, Tensor], base_model: str | None = None,
                       file: Path | None = None) -> tuple[dict, dict]:
    """This project's EAGLE export -> the EAGLE repository's (EAGLE-1) / SpecForge's (EAGLE-3) config + state dict."""
    cfg = _strip(config)
    out = dict(tensors)
    h = int(config["hidden_size"])
    if kind == "eagle":
        out.setdefault("fc.bias", torch.zeros(h, dtype=out["fc.weight"].dtype))
        cfg["architectures"] = ["LlamaForCausalLM"]  # ea_model.py: the draft config's architectures is not read
    else:
        vocab, draft = int(config["vocab_size"]), int(config.get("draft_vocab_size") or config["vocab_size"])
        if "d2t" not in out:  # SpecForge writes d2t / t2d always, full vocabulary included
            out["d2t"] = torch.zeros(draft, dtype=torch.long)
            out["t2d"] = torch.arange(vocab) < draft
        cfg["draft_vocab_size"] = draft
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    return cfg, out

"""Medusa's export layout: vLLM's Medusa config and tensors, and FasterDecoding/Medusa's reference layout
(models/families.py registers it; models/exports/io.py does the files).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.formats import parts
from models.formats.config import ExportConfig
from models.medusa import MedusaHeads
from runtime.errors import UserError
from runtime.io import load_state

# -- the export layout (models/families.py registers it; models/exports/io.py does the files) ----------------------

@dataclass(frozen=True, kw_only=True)
class MedusaConfig(ExportConfig):
    """A Medusa export's config.json keys, as vLLM's Medusa reader (and this toolkit's) takes them."""

    model_type: str = field(default="medusa", metadata={"help": "the layout vLLM reads: Medusa's",
                                                        "choices": ("medusa",)})
    num_heads: int = field(metadata={"help": "the heads, head k drafting token t+k+2", "min": 1})
    num_hidden_layers: int = field(metadata={"help": "the residual blocks of each head", "min": 1})
    hidden_size: int = field(metadata={"help": "the verifier's hidden size, each block's width",
                                                  "min": 1})
    vocab_size: int | None = field(default=None, metadata={"help": "the vocabulary the heads project to (null: "
                                                                   "the verifier's)", "min": 1})
    truncated_vocab_size: int | None = field(default=None, metadata={"help": "the vocabulary vLLM keeps (the whole "
                                                                             "one)", "min": 1})
    medusa_fc_bias: bool = field(default=True, metadata={"help": "whether the blocks' linear layers have biases "
                                                                 "(this toolkit's always do)", "choices": (True,)})
    original_lm_head: bool = field(default=False, metadata={"help": "whether every head shares the verifier's "
                                                                    "lm_head (written once as lm_head.weight)"})


def medusa_layout(heads: MedusaHeads, verifier: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """vLLM's Medusa layout: the config keys (MedusaConfig; `architectures` comes from the registry) and the tensors.
    A shared head is written once as `lm_head.weight` (vLLM shares it across heads when `original_lm_head`)."""
    config = MedusaConfig(num_heads=heads.num_heads, num_hidden_layers=heads.num_layers,
                          hidden_size=heads.hidden_size, vocab_size=heads.vocab_size,
                          truncated_vocab_size=heads.vocab_size, original_lm_head=heads.share_lm_head).to_config()
    tensors = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    if heads.share_lm_head:
        tensors["lm_head.weight"] = verifier.lm_head.weight.detach().cpu().contiguous()
    return config, tensors


def medusa_from_layout(config: dict[str, Any], tensors: dict[str, Tensor], verifier: Any, file: Path,
                       reference: bool) -> tuple[MedusaHeads, Tensor | None]:
    """The heads an export holds, and the export's copy of the shared head (None when each head has its own)."""
    cfg = MedusaConfig.from_config(config, file.parent / "config.json")
    heads = {int(k.split(".")[1]) for k in tensors if k.startswith("blocks.")}
    if len(heads) != cfg.num_heads:
        raise UserError(f"{file}: config.json num_heads={cfg.num_heads} but the weights hold {len(heads)} heads "
                        f"(blocks.{{0..{len(heads) - 1}}}). Re-export the checkpoint, or fix num_heads.")
    w = tensors.get("blocks.0.layers.0.weight")
    if w is not None and tuple(w.shape) != (cfg.hidden_size,) * 2:
        raise UserError(f"{file}: config.json hidden_size={cfg.hidden_size} but blocks.0.layers.0.weight is "
                        f"{tuple(w.shape)}. Re-export the checkpoint, or fix hidden_size.")
    shared = cfg.original_lm_head
    own = verifier.lm_head.weight.detach().cpu()
    num = cfg.num_heads
    if reference and not shared and all(torch.equal(tensors[f"lm_heads.{h}.weight"].to(own.dtype), own)
                                        for h in range(num)):
        shared = True  # the reference copies a shared head into every head: share it again
        for h in range(num):
            tensors.pop(f"lm_heads.{h}.weight")
        config["original_lm_head"] = True
    net = MedusaHeads(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size or verifier.vocab_size,
                      num_heads=num, num_layers=cfg.num_hidden_layers, share_lm_head=shared)
    lm_head = tensors.pop("lm_head.weight", None) if shared else None
    load_state(net, tensors, file)
    return net, lm_head


def medusa_weights_agree(config: dict[str, Any], shapes: parts.Shapes) -> list[parts.Disagreement]:
    """A Medusa export's num_heads, num_hidden_layers and hidden_size against its `blocks.{h}.layers.{l}` tensors."""
    heads = sorted({int(k.split(".")[1]) for k in shapes if k.startswith("blocks.")})
    layers = sorted({int(k.split(".")[3]) for k in shapes if k.startswith("blocks.0.layers.")})
    out = []
    for key, found, tensor, noun in (("num_heads", heads, "blocks.{h}", "heads"),
                                     ("num_hidden_layers", layers, "blocks.0.layers.{l}", "layers per head")):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1 and found and value != len(found):
            out.append(parts.Disagreement(key, value, f"{tensor}.*", f"{len(found)} {noun}", f"{value} {noun}"))
    hidden, w = config.get("hidden_size"), shapes.get("blocks.0.layers.0.weight")
    if isinstance(hidden, int) and not isinstance(hidden, bool) and w is not None and w != [hidden, hidden]:
        out.append(parts.Disagreement("hidden_size", hidden, "blocks.0.layers.0.weight", w, f"[{hidden}, {hidden}]"))
    return out


# -- the reference layout (models/exports/reference.py): FasterDecoding/Medusa ---------------------------------------

_MEDUSA_KEY = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


def is_medusa_reference(config: dict[str, Any], names: list[str]) -> bool:
    """The Medusa repository's layout: `{h}.{l}.linear.weight|bias` tensors, or `medusa_num_heads` in its config."""
    return any(_MEDUSA_KEY.match(n) for n in names) or "medusa_num_heads" in config


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


def medusa_to_reference(config: dict[str, Any], tensors: dict[str, Tensor], base_model: str | None,
                        file: Path) -> tuple[dict, dict]:
    """This project's Medusa export -> the reference config + state dict (`{h}.0.linear.*`, `{h}.1.weight`)."""
    cfg = MedusaConfig.from_config(config, file.parent / "config.json")
    layers = cfg.num_hidden_layers
    if layers != 1:
        raise UserError(f"{file.parent / 'config.json'}: num_hidden_layers={layers}; the Medusa reference shares one "
                        f"ResBlock across its layers, so only 1-layer heads convert. Retrain with model.num_layers=1.")
    heads = cfg.num_heads
    out: dict[str, Tensor] = {}
    for h in range(heads):
        out[f"{h}.0.linear.weight"] = tensors[f"blocks.{h}.layers.0.weight"]
        out[f"{h}.0.linear.bias"] = tensors[f"blocks.{h}.layers.0.bias"]
        proj = tensors.get("lm_head.weight") if cfg.original_lm_head else tensors.get(f"lm_heads.{h}.weight")
        if proj is None:
            raise UserError(f"{file}: no vocabulary projection for head {h} (lm_head.weight with original_lm_head, "
                            f"else lm_heads.{h}.weight); re-export it with train.py.")
        out[f"{h}.1.weight"] = proj.clone()  # one tensor per head: the reference has no shared head
    ref = {"medusa_num_heads": heads, "medusa_num_layers": 1, "base_model_name_or_path": base_model,
           "hidden_size": cfg.hidden_size, "vocab_size": int(config["vocab_size"])}
    return ref, out

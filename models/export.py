"""Export I/O for every drafter family, in one place: write atomically, read the config and the weights, detect the
kind, check the verifier, rebuild the network.

An export is a directory with `config.json` and `model.safetensors`:
- Medusa: vLLM's Medusa layout (`model_type: medusa`, `blocks.{h}.layers.{l}.*`, `lm_heads.{h}.weight` or one
  shared `lm_head.weight` with `original_lm_head: true`);
- EAGLE-1 / EAGLE-3: the Llama-drafter layouts vLLM and SGLang load (`architectures` names the kind).
Every config also carries this project's keys: `verifier` (the description `models.verifier.load_verifier` takes),
`verifier_path` (a display name, and what older exports stored), `verifier_fingerprint`, and what training adds
(accuracy tables, trained steps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.eagle import NAMES, EAGLE_NETS, Eagle1Net, Eagle3Net, EagleNet, check_aux_layers, layer_config
from models.errors import UserError
from models.io import atomic_dir
from models.medusa import MedusaHeads
from models.verifier import Verifier, check_fingerprint, verifier_source

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
EAGLE_ARCHITECTURES = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}
KIND_NAMES = {"medusa": "Medusa", **NAMES}


@dataclass
class Export:
    """A loaded export: its kind (`medusa`, `eagle`, `eagle3`), the network, its config, and for a Medusa export
    that shares the verifier's head, the export's own copy of that head's weight."""

    kind: str
    net: MedusaHeads | EagleNet
    config: dict[str, Any]
    lm_head: Tensor | None = None


# -- reading ---------------------------------------------------------------------------------------------------------

def read_config(path: str | Path) -> dict[str, Any]:
    """An export's config.json, with a clear error for a missing or corrupt one."""
    path = Path(path).expanduser()
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise UserError(f"checkpoint={str(path)!r}: no {CONFIG_NAME} there. Pass the `export/` directory train.py printed.")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_file} is not valid UTF-8 JSON ({e}); re-export the checkpoint.") from e
    if not isinstance(config, dict):
        raise UserError(f"{cfg_file} holds a JSON {type(config).__name__}, not an object of config keys; "
                        f"re-export the checkpoint.")
    return config


def _require(config: dict[str, Any], keys: tuple[str, ...], path: Path) -> None:
    missing = [k for k in keys if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)]
    if missing:
        raise UserError(f"{path / CONFIG_NAME} lacks the whole-number key(s) {missing} a {config.get('model_type')} "
                        f"export needs; re-export the checkpoint.")


def read_weights(path: str | Path) -> dict[str, Tensor]:
    path = Path(path).expanduser()
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise UserError(f"checkpoint={str(path)!r}: {WEIGHTS_NAME} is missing. Re-export it (train.py writes it on fit end).")
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{weights} is corrupt or truncated ({e}); re-export the checkpoint.") from e


def export_kind(config: dict[str, Any]) -> str | None:
    """`medusa`, `eagle` or `eagle3` from an export's config; None if it is none of them."""
    if config.get("model_type") == "medusa":
        return "medusa"
    arch = (config.get("architectures") or [""])[0]
    return {v: k for k, v in EAGLE_ARCHITECTURES.items()}.get(arch) or config.get("eagle_kind")


def export_verifier(config: dict[str, Any]) -> dict[str, Any] | None:
    """The verifier description an export stores (older exports: the `verifier_path` string), or None."""
    if config.get("verifier"):
        return verifier_source(config["verifier"])
    if config.get("verifier_path"):
        return verifier_source(str(config["verifier_path"]))
    return None


def _load_state(net: nn.Module, tensors: dict[str, Tensor], path: Path) -> None:
    try:
        net.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise UserError(f"{path / WEIGHTS_NAME} does not match its config.json: {str(e).splitlines()[0]}") from e


def load_export(path: str | Path, verifier: Verifier, kind: str | None = None) -> Export:
    """Rebuild the drafter an export holds, refusing one of another kind than `kind` (when given) or one made for
    another verifier."""
    path = Path(path).expanduser()
    config = read_config(path)
    found = export_kind(config)
    if found is None:
        raise UserError(f"checkpoint={str(path)!r} is neither a Medusa nor an EAGLE export (model_type="
                        f"{config.get('model_type')!r}, architectures={config.get('architectures')}).")
    if kind is not None and found != kind:
        raise UserError(f"checkpoint={str(path)!r} is an {KIND_NAMES[found]} export but was given as "
                        f"{KIND_NAMES.get(kind, kind)}. Use drafter={found} for it, or pass an {KIND_NAMES.get(kind, kind)} "
                        f"export.")
    if not isinstance(config.get("verifier_fingerprint"), dict) or not config["verifier_fingerprint"]:
        raise UserError(f"{path / CONFIG_NAME} has no verifier_fingerprint, so it cannot be checked against the verifier "
                        f"it is used with. Re-export it with this toolkit (train.py), or convert a reference-format "
                        f"checkpoint with scripts/convert.py.")
    check_fingerprint(config["verifier_fingerprint"], verifier, f"{KIND_NAMES[found]} export {str(path)!r}")
    tensors = read_weights(path)
    if found == "medusa":
        _require(config, ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"), path)
        shared = bool(config.get("original_lm_head", False))
        heads = MedusaHeads(hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                            num_heads=config["num_heads"], num_layers=config["num_hidden_layers"], share_lm_head=shared)
        lm_head = tensors.pop("lm_head.weight", None) if shared else None
        _load_state(heads, tensors, path)
        return Export(found, heads.eval().requires_grad_(False), config, lm_head)
    lc = layer_config(verifier)
    if found == "eagle3":
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        check_aux_layers(list(aux or []), lc["num_verifier_layers"])
        t2d, d2t = tensors.get("t2d"), tensors.get("d2t")
        if (t2d is None or d2t is None or t2d.numel() != lc["vocab_size"]
                or int((d2t + d2t.new_tensor(range(d2t.numel()))).max()) >= lc["vocab_size"]):
            raise UserError(f"{path / WEIGHTS_NAME}: the draft vocabulary (d2t/t2d) does not fit the verifier's "
                            f"vocabulary of {lc['vocab_size']} tokens. Retrain the drafter for this verifier.")
        net: EagleNet = Eagle3Net(draft_vocab_size=config.get("draft_vocab_size"), aux_layer_ids=aux, **lc)
    else:
        net = Eagle1Net(**lc)
    _load_state(net, tensors, path)
    return Export(found, net.eval().requires_grad_(False), config)


# -- writing ---------------------------------------------------------------------------------------------------------

def _verifier_keys(verifier: Verifier) -> dict[str, Any]:
    loader = verifier.source["loader"]
    path = {"hf": verifier.source.get("path"), "smollm2": "smollm2"}.get(loader, verifier.name)
    return {"verifier": verifier.source, "verifier_path": path, "verifier_fingerprint": verifier.fingerprint}


def _medusa_config(heads: MedusaHeads) -> dict[str, Any]:
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "truncated_vocab_size": heads.vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": heads.share_lm_head,
    }


def _eagle_config(net: EagleNet, verifier: Verifier) -> dict[str, Any]:
    lc = layer_config(verifier)
    config = {
        "architectures": [EAGLE_ARCHITECTURES[net.kind]],
        "model_type": "llama",
        "hidden_size": lc["hidden_size"],
        "intermediate_size": lc["intermediate_size"],
        "num_attention_heads": lc["num_attention_heads"],
        "num_key_value_heads": lc["num_key_value_heads"],
        "head_dim": lc["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": lc["rms_norm_eps"],
        "rope_theta": lc["rope_theta"],
        "attention_bias": lc["attention_bias"],
        "hidden_act": "silu",
        "vocab_size": lc["vocab_size"],
        "max_position_embeddings": int(getattr(verifier.config, "max_position_embeddings", 2048)),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_kind": net.kind,
        "verifier_num_hidden_layers": lc["num_verifier_layers"],
    }
    if isinstance(net, Eagle3Net):
        config["draft_vocab_size"] = net.draft_vocab_size
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": net.aux_layer_ids, "use_aux_hidden_state": True}
    return config


def save_export(net: MedusaHeads | EagleNet, verifier: Verifier, path: str | Path,
                extra: dict[str, Any] | None = None) -> Path:
    """Write `config.json` + `model.safetensors` for a Medusa or EAGLE drafter, atomically. Returns the directory."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    if isinstance(net, MedusaHeads):
        config = _medusa_config(net)
        if net.share_lm_head:  # vLLM reads one `lm_head.weight` and shares it across heads when `original_lm_head`
            tensors["lm_head.weight"] = verifier.lm_head.weight.detach().cpu().contiguous()
    elif isinstance(net, tuple(EAGLE_NETS.values())):
        config = _eagle_config(net, verifier)
    else:
        raise TypeError(f"save_export takes MedusaHeads or an EAGLE net, not {type(net).__name__}")
    config |= _verifier_keys(verifier) | (extra or {})
    text = json.dumps(config, indent=2)  # before any file is written: a value that is not JSON fails here
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(text)
    return Path(path)

"""Export I/O for every drafter family, in one place: write atomically, read the config and the weights, detect the
kind, check the verifier, rebuild the network.

An export is a directory an engine loads as it is: `config.json` and `model.safetensors`, and nothing else an
engine globs (vLLM loads every `*.safetensors` at the top of the folder):
- Medusa: vLLM's Medusa layout (`model_type: medusa`, `blocks.{h}.layers.{l}.*`, `lm_heads.{h}.weight` or one
  shared `lm_head.weight` with `original_lm_head: true`);
- EAGLE-3: the `speculators` format (models/speculators_format.py), which `vllm serve EXPORT_DIR` serves as it is;
- EAGLE-1: the Llama-drafter layout vLLM and SGLang load (`architectures` names the kind).
Every config also carries this project's keys: `verifier` (the description `models.verifier.load_verifier` takes),
`verifier_path` (a display name, and what older exports stored), `verifier_fingerprint`, and what training adds
(accuracy tables, trained steps). Side data that is not the drafter's weights lives in the `specdraft/` subfolder
(SIDE_DIR), where no engine looks.
"""

from __future__ import annotations

import json
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.eagle import NAMES, EAGLE_NETS, Eagle1Net, Eagle3Net, EagleNet, check_aux_layers, layer_config
from models import reference_formats as ref
from models import speculators_format as spec
from models.errors import UserError
from models.io import atomic_dir
from models.medusa import MedusaHeads
from models.verifier import Verifier, check_fingerprint, verifier_source

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SIDE_DIR = "specdraft"  # this project's side data, in a subfolder no engine reads
COUNTS_NAME = "target_counts.safetensors"  # training-target counts per verifier token (optional), in SIDE_DIR
ENGINE_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # what vLLM's loader globs at the folder's top
# SGLang takes the first registered name (LlamaForCausalLMEagle); vLLM resolves the list through the second
# (EagleLlamaForCausalLM, kept as is by its EAGLEConfig). Never plain LlamaForCausalLM: SGLang would build the target.
EAGLE_ARCHITECTURES = {"eagle": ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"], "eagle3": ["LlamaForCausalLMEagle3"]}
ARCHITECTURE_KINDS = {"LlamaForCausalLMEagle": "eagle", "EagleLlamaForCausalLM": "eagle",
                      "LlamaForCausalLMEagle3": "eagle3", "Eagle3LlamaForCausalLM": "eagle3"}
SERVING_DTYPES = ("bfloat16", "float16")
KIND_NAMES = {"medusa": "Medusa", **NAMES}


@dataclass
class Export:
    """A loaded export: its kind (`medusa`, `eagle`, `eagle3`), the network, its config, and for a Medusa export
    that shares the verifier's head, the export's own copy of that head's weight."""

    kind: str
    net: MedusaHeads | EagleNet
    config: dict[str, Any]
    lm_head: Tensor | None = None
    target_counts: Tensor | None = None  # (V,) how often each verifier token was a training target (COUNTS_NAME)

    @property
    def train_ids(self) -> Tensor | None:
        """The verifier ids a drafter trained with `model.train_vocab` scores over (sorted), or None (all V)."""
        size = self.config.get("train_vocab")
        if not size:
            return None
        if self.target_counts is None:
            raise UserError(f"this export was trained over its {size} most frequent targets (train_vocab) but has no "
                            f"{COUNTS_NAME} to say which: re-export it (python train.py <the run's overrides> "
                            f"ckpt_path=last validate_only=true).")
        return frequent_ids(self.target_counts, int(size), "train_vocab")


# -- reading ---------------------------------------------------------------------------------------------------------

def _raw_config(path: Path) -> dict[str, Any]:
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise UserError(f"checkpoint={str(path)!r}: no {CONFIG_NAME} there. Pass the `export/` directory train.py printed "
                        f"(or a Medusa / EAGLE reference checkpoint directory).")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_file} is not valid UTF-8 JSON ({e}); re-export the checkpoint.") from e
    if not isinstance(config, dict):
        raise UserError(f"{cfg_file} holds a JSON {type(config).__name__}, not an object of config keys; "
                        f"re-export the checkpoint.")
    return spec.flatten(config, str(cfg_file)) if spec.is_speculators(config) else config


def _require(config: dict[str, Any], keys: tuple[str, ...], path: Path) -> None:
    missing = [k for k in keys if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)]
    if missing:
        raise UserError(f"{path / CONFIG_NAME} lacks the whole-number key(s) {missing} a {config.get('model_type')} "
                        f"export needs; re-export the checkpoint.")


def _is_project_export(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "medusa" or "verifier_fingerprint" in config or "eagle_kind" in config


def _load_tensors(file: Path) -> dict[str, Tensor]:
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise UserError(f"{file} is corrupt, truncated or not a plain tensor file ({e}); re-export the checkpoint.") from e
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise UserError(f"{file} is not a state dict of tensors; expected the reference layout's {file.name}.")
    return state


def _read_reference(path: Path, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A directory in one of the reference layouts, as this project's (config, tensors); an unknown layout refused."""
    medusa = next((path / f for f in ref.MEDUSA_FILES if (path / f).is_file()), None)
    if medusa is not None:
        return ref.medusa_from_reference(config, _load_tensors(medusa), medusa)
    weights = next((path / f for f in ref.EAGLE_FILES if (path / f).is_file()), None)
    if weights is None:
        raise UserError(f"checkpoint={str(path)!r}: {CONFIG_NAME} is not a specdraft export (no model_type 'medusa', "
                        f"no verifier_fingerprint) and there is no weight file of a reference layout "
                        f"({', '.join(ref.MEDUSA_FILES + ref.EAGLE_FILES)}).")
    tensors = _load_tensors(weights)
    kind = ref.layout_of(config, list(tensors))
    if kind not in ("eagle", "eagle3"):
        names = sorted(tensors)[:6]
        raise UserError(f"{weights}: unknown layout: not a specdraft export ({path / CONFIG_NAME} has no "
                        f"verifier_fingerprint; architectures={config.get('architectures')}) and its tensors {names} "
                        f"are none of the reference layouts (EAGLE-3: midlayer.*; EAGLE-1: fc.weight + layers.0.*; "
                        f"Medusa: medusa_lm_head.* with {{h}}.{{l}}.linear.*). Convert it with scripts/convert.py or "
                        f"pass an export train.py wrote.")
    return ref.eagle_from_reference(kind, config, tensors)


def read_config(path: str | Path) -> dict[str, Any]:
    """An export's config.json, with a clear error for a missing or corrupt one. A reference-layout checkpoint
    (Medusa, EAGLE-1, EAGLE-3: models/reference_formats.py) is returned as this project's config, with
    `reference_layout` set and `verifier_path` taken from `base_model_name_or_path` when it has one."""
    path = Path(path).expanduser()
    config = _raw_config(path)
    return config if _is_project_export(config) else _read_reference(path, config)[0]


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """An export's tensors by this project's names (a reference layout's renamed)."""
    path = Path(path).expanduser()
    config = _raw_config(path)
    if not _is_project_export(config):
        return _read_reference(path, config)[1]
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise UserError(f"checkpoint={str(path)!r}: {WEIGHTS_NAME} is missing. Re-export it (train.py writes it on fit end).")
    return _load_tensors(weights)


def export_kind(config: dict[str, Any]) -> str | None:
    """`medusa`, `eagle` or `eagle3` from an export's config; None if it is none of them."""
    if config.get("model_type") == "medusa":
        return "medusa"
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURE_KINDS:
            return ARCHITECTURE_KINDS[arch]
    return config.get("eagle_kind") if config.get("eagle_kind") in EAGLE_NETS else None


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


def aux_layer_ids(config: dict[str, Any], num_layers: int, file: str | Path = CONFIG_NAME) -> list[int]:
    """An EAGLE-3 export's feature layers in this project's convention (id k = input of layer k = HF
    `hidden_states[k]`), refusing ids that an engine would read differently.

    The top-level `eagle_aux_hidden_state_layer_ids` is this convention (vLLM reads it); `eagle_config.
    eagle_aux_hidden_state_layer_ids` must then be each id minus 1 (SGLang adds 1). An older export with only the
    nested key stored this convention there; none at all = the engines' default [2, L//2, L-3]."""
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
    check_aux_layers(default, num_layers, f"{file}: no eagle_aux_hidden_state_layer_ids, so the engines' default")
    return default


def _check_medusa(config: dict[str, Any], tensors: dict[str, Tensor], file: Path) -> None:
    heads = {int(k.split(".")[1]) for k in tensors if k.startswith("blocks.")}
    if len(heads) != int(config["num_heads"]):
        raise UserError(f"{file}: config.json num_heads={config['num_heads']} but the weights hold {len(heads)} heads "
                        f"(blocks.{{0..{len(heads) - 1}}}). Re-export the checkpoint, or fix num_heads.")
    w = tensors.get("blocks.0.layers.0.weight")
    if w is not None and tuple(w.shape) != (config["hidden_size"],) * 2:
        raise UserError(f"{file}: config.json hidden_size={config['hidden_size']} but blocks.0.layers.0.weight is "
                        f"{tuple(w.shape)}. Re-export the checkpoint, or fix hidden_size.")


def _check_eagle(config: dict[str, Any], tensors: dict[str, Tensor], file: Path, verifier_hidden: int) -> None:
    fc = tensors.get("fc.weight")
    if fc is None:
        raise UserError(f"{file}: no fc.weight tensor; this is not an EAGLE export. Re-export the checkpoint.")
    if "hidden_size" in config and int(fc.shape[0]) != int(config["hidden_size"]):
        raise UserError(f"{file}: config.json hidden_size={config['hidden_size']} but fc.weight is {tuple(fc.shape)} "
                        f"(hidden size {fc.shape[0]}). Re-export the checkpoint, or fix hidden_size.")
    if int(fc.shape[0]) != verifier_hidden:
        raise UserError(f"{file}: fc.weight {tuple(fc.shape)} is for a hidden size of {fc.shape[0]}, but the verifier's "
                        f"hidden_size is {verifier_hidden}. Pass the verifier the drafter was trained on.")


def load_export(path: str | Path, verifier: Verifier, kind: str | None = None) -> Export:
    """Rebuild the drafter an export holds, refusing one of another kind than `kind` (when given) or one made for
    another verifier. A reference-layout checkpoint (models/reference_formats.py) loads too; having no fingerprint,
    it is checked against the verifier by shape only."""
    path = Path(path).expanduser()
    config = read_config(path)
    cfg_file = path / CONFIG_NAME
    found = export_kind(config)
    if found is None:
        raise UserError(f"{cfg_file}: model_type={config.get('model_type')!r}, architectures="
                        f"{config.get('architectures')}: neither a Medusa nor an EAGLE export (expected model_type "
                        f"'medusa' or architectures naming one of {sorted(ARCHITECTURE_KINDS)}).")
    if kind is not None and found != kind:
        raise UserError(f"checkpoint={str(path)!r} is an {KIND_NAMES[found]} export but was given as "
                        f"{KIND_NAMES.get(kind, kind)}. Use drafter={found} for it, or pass an {KIND_NAMES.get(kind, kind)} "
                        f"export.")
    reference = bool(config.get("reference_layout"))  # names no verifier: the one given is trusted
    if not reference:
        if not isinstance(config.get("verifier_fingerprint"), dict) or not config["verifier_fingerprint"]:
            raise UserError(f"{path / CONFIG_NAME} has no verifier_fingerprint, so it cannot be checked against the "
                            f"verifier it is used with. Re-export it with this toolkit (train.py), or convert a "
                            f"reference-format checkpoint with scripts/convert.py.")
        check_fingerprint(config["verifier_fingerprint"], verifier, f"{KIND_NAMES[found]} export {str(path)!r}")
        if [f for f in stray_weight_files(path) if f.name != COUNTS_NAME]:
            check_engine_ready(path)  # a stray weight file: refused with its name and the fix
        if (path / COUNTS_NAME).is_file():  # written before the side data moved: loads here, vLLM refuses it
            warnings.warn(f"{path / COUNTS_NAME}: this export was written before side data moved to {SIDE_DIR}/; it "
                          f"loads here, but vLLM refuses the folder. Rewrite it: python scripts/convert.py "
                          f"from-reference {path} <new dir>.", stacklevel=2)
    tensors = read_weights(path)
    weights = path / WEIGHTS_NAME
    if found == "medusa":
        _require(config, ("hidden_size", "num_heads", "num_hidden_layers"), path)
        _check_medusa(config, tensors, weights)
        shared = bool(config.get("original_lm_head", False))
        lm_head = verifier.lm_head.weight.detach().cpu()
        if reference and not shared and all(torch.equal(tensors[f"lm_heads.{h}.weight"].to(lm_head.dtype), lm_head)
                                            for h in range(int(config["num_heads"]))):
            shared = True  # the reference copies a shared head into every head: share it again
            for h in range(int(config["num_heads"])):
                tensors.pop(f"lm_heads.{h}.weight")
            config["original_lm_head"] = True
        heads = MedusaHeads(hidden_size=config["hidden_size"], vocab_size=int(config.get("vocab_size") or verifier.vocab_size),
                            num_heads=config["num_heads"], num_layers=config["num_hidden_layers"], share_lm_head=shared)
        lm_head = tensors.pop("lm_head.weight", None) if shared else None
        _load_state(heads, tensors, path)
        return Export(found, heads.eval().requires_grad_(False), config, lm_head,
                      read_target_counts(path, heads.vocab_size))
    lc = layer_config(verifier)
    _check_eagle(config, tensors, weights, lc["hidden_size"])
    if found == "eagle3":
        aux = aux_layer_ids(config, lc["num_verifier_layers"], cfg_file)
        draft = min(int(config.get("draft_vocab_size") or lc["vocab_size"]), lc["vocab_size"])
        d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
        if draft == lc["vocab_size"]:
            if d2t is not None and bool(d2t.any()):
                raise UserError(f"{weights}: d2t is not all zeros but draft_vocab_size = the vocabulary size "
                                f"({draft}): a full-vocabulary draft maps ids to themselves. Re-export the checkpoint.")
        else:
            if d2t is None:
                raise UserError(f"{weights}: no d2t tensor, but draft_vocab_size={draft} is smaller than the "
                                f"verifier's vocabulary ({lc['vocab_size']}): the draft ids cannot be mapped.")
            if t2d is None and d2t.numel() == draft:
                target = d2t.long() + torch.arange(d2t.numel())
                if int(target.max()) < lc["vocab_size"]:
                    t2d = torch.zeros(lc["vocab_size"], dtype=torch.bool)
                    t2d[target] = True
            if (t2d is None or t2d.numel() != lc["vocab_size"] or d2t.numel() != draft
                    or int((d2t + d2t.new_tensor(range(d2t.numel()))).max()) >= lc["vocab_size"]):
                raise UserError(f"{weights}: the draft vocabulary (d2t/t2d) does not fit the verifier's "
                                f"vocabulary of {lc['vocab_size']} tokens. Retrain the drafter for this verifier.")
            tensors |= {"d2t": d2t.long(), "t2d": t2d.bool()}
        net: EagleNet = Eagle3Net(draft_vocab_size=draft, aux_layer_ids=aux, **lc)
    else:
        bias = tensors.get("fc.bias")
        if bias is not None and not bool(bias.any()):
            tensors.pop("fc.bias")  # the zero bias the export writes for SGLang and the EAGLE repository
        net = Eagle1Net(fc_bias="fc.bias" in tensors, **lc)
    _load_state(net, tensors, path)
    return Export(found, net.eval().requires_grad_(False), config, target_counts=read_target_counts(path, lc["vocab_size"]))


def read_target_counts(path: Path, vocab_size: int) -> Tensor | None:
    """The export's training-target counts (`SIDE_DIR/COUNTS_NAME`; exports written before the side data moved there
    have it beside the weights, and still load here), or None when it has none."""
    file = next((f for f in (path / SIDE_DIR / COUNTS_NAME, path / COUNTS_NAME) if f.is_file()), None)
    if file is None:
        return None
    try:
        counts = load_file(str(file))["counts"]
    except Exception as e:
        raise UserError(f"{file} cannot be read ({type(e).__name__}: {e}). Delete it (the drafter works without "
                        f"it) or re-export the drafter.") from e
    if counts.ndim != 1 or counts.numel() != vocab_size:
        raise UserError(f"{file} counts {counts.numel()} tokens but the verifier has {vocab_size}: it belongs to "
                        f"another verifier. Delete it or re-export the drafter.")
    return counts


def check_vocab_size(size: Any, vocab_size: int, setting: str) -> None:
    """A number of kept tokens (`setting` names the option in the message) must be a whole number in 1..vocab_size."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab_size:
        raise UserError(f"{setting}={size!r}: give a number of tokens in 1..{vocab_size} (the vocabulary size), "
                        f"or null for the full vocabulary.")


def frequent_ids(counts: Tensor, size: int, setting: str = "drafter.draft_vocab") -> Tensor:
    """The `size` tokens most often a training target in `counts` (V,) (ties: lower id first), sorted by id: the rows
    of the verifier's lm_head a lean drafting head keeps (`setting` names the option in errors)."""
    check_vocab_size(size, counts.numel(), setting)
    order = torch.sort(-counts.double(), stable=True).indices
    return order[:size].sort().values


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


def _serving_dtype(verifier: Verifier) -> str:
    """The dtype the drafter is served in: the verifier's own when it is a serving dtype, else bfloat16 (SGLang with
    --dtype auto would turn a declared float32 into float16 beside a bf16 target)."""
    declared = str(getattr(verifier.config, "dtype", None) or getattr(verifier.config, "torch_dtype", None) or "")
    declared = declared.replace("torch.", "")
    return declared if declared in SERVING_DTYPES else "bfloat16"


def _eagle_config(net: EagleNet, verifier: Verifier) -> dict[str, Any]:
    lc = layer_config(verifier)
    dtype = _serving_dtype(verifier)
    config = {
        "architectures": list(EAGLE_ARCHITECTURES[net.kind]),
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
        "torch_dtype": dtype,
        "dtype": dtype,
        "eagle_kind": net.kind,
        "verifier_num_hidden_layers": lc["num_verifier_layers"],
    }
    if isinstance(net, Eagle3Net):
        ids = list(net.aux_layer_ids)
        check_aux_layers(ids, lc["num_verifier_layers"])
        config["draft_vocab_size"] = net.draft_vocab_size
        # vLLM (both model runners) reads the top-level key, as the input of layer k (this project's convention);
        # SGLang reads only the nested one, as the output of layer k (it adds 1): the same layers, written twice.
        config["eagle_aux_hidden_state_layer_ids"] = ids
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids], "use_aux_hidden_state": True}
    return config


def served_verifier(verifier: Verifier) -> str:
    """What an engine serving the export loads as its verifier: the verifier's checkpoint (a local directory or a
    Hub id), else its display name (a verifier built in memory: `models.verifier.save_checkpoint` writes one)."""
    return verifier.checkpoint or verifier.name


def save_export(net: MedusaHeads | EagleNet, verifier: Verifier, path: str | Path,
                extra: dict[str, Any] | None = None, target_counts: Tensor | None = None,
                speculative_tokens: int = spec.DEFAULT_SPECULATIVE_TOKENS, served: str | None = None) -> Path:
    """Write `config.json` + `model.safetensors` for a Medusa or EAGLE drafter, atomically. Returns the directory.
    `target_counts` (V,): how often each verifier token was a training target, written as `SIDE_DIR/COUNTS_NAME`
    (the decoder's `draft_vocab` reads it; no engine looks there). An EAGLE-3 export is in the speculators format:
    `speculative_tokens` is the chain vLLM drafts when it serves the folder as it is, and `served` (default:
    `served_verifier(verifier)`) the verifier it loads."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    if isinstance(net, MedusaHeads):
        config = _medusa_config(net)
        if net.share_lm_head:  # vLLM reads one `lm_head.weight` and shares it across heads when `original_lm_head`
            tensors["lm_head.weight"] = verifier.lm_head.weight.detach().cpu().contiguous()
    elif isinstance(net, tuple(EAGLE_NETS.values())):
        config = _eagle_config(net, verifier)
        if "fc.bias" not in tensors and isinstance(net, Eagle1Net):
            # SGLang and the EAGLE repository build fc with a bias and would leave a missing one random; vLLM drops
            # an unexpected `.bias` (harmless: it is zero). Not `"bias": true` in the config: engines read that as
            # "attention has biases".
            tensors["fc.bias"] = torch.zeros(net.hidden_size, dtype=net.fc.weight.dtype)
    else:
        raise TypeError(f"save_export takes MedusaHeads or an EAGLE net, not {type(net).__name__}")
    config |= _verifier_keys(verifier) | (extra or {})
    if config.get("eagle_kind") in spec.SPECULATORS_KINDS:
        architectures = list(getattr(verifier.config, "architectures", None) or [type(verifier.model).__name__])
        config = spec.to_speculators(config, served or served_verifier(verifier), architectures, speculative_tokens)
    text = json.dumps(config, indent=2)  # before any file is written: a value that is not JSON fails here
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(text)
        if target_counts is not None:
            (tmp / SIDE_DIR).mkdir()
            save_file({"counts": target_counts.detach().cpu().double().contiguous()}, str(tmp / SIDE_DIR / COUNTS_NAME))
    return Path(path)


def stray_weight_files(path: str | Path) -> list[Path]:
    """Files at the top of an export folder that a serving engine would load as weights besides WEIGHTS_NAME
    (vLLM globs `*.safetensors`, else `*.bin` / `*.pt`, and refuses tensors its drafter has no parameter for)."""
    path = Path(path).expanduser()
    return sorted(f for f in path.iterdir() if f.is_file() and f.name != WEIGHTS_NAME
                  and f.suffix in ENGINE_WEIGHT_SUFFIXES)


def check_engine_ready(path: str | Path) -> None:
    """Refuse an export folder that a serving engine would not load as it is: a stray weight file beside the
    weights (one message naming it and the fix)."""
    path = Path(path).expanduser()
    for f in sorted(stray_weight_files(path), key=lambda f: f.name == COUNTS_NAME):  # a foreign file named first
        legacy = f.name == COUNTS_NAME
        fix = (f"an export written before the side data moved to {SIDE_DIR}/: rewrite it with `python "
               f"scripts/convert.py from-reference {path} <new dir>` (or move the file to {path / SIDE_DIR / f.name})"
               if legacy else f"move it out of the folder (this toolkit keeps side data in {SIDE_DIR}/)")
        raise UserError(f"{f}: a weight file beside {WEIGHTS_NAME}. vLLM loads every *.safetensors in an export "
                        f"folder and refuses tensors its drafter has no parameter for, so it would not serve "
                        f"{path}: {fix}.")


# -- the reference layouts (models/reference_formats.py), both ways ----------------------------------------------------

REFERENCE_WEIGHTS = {"medusa": ("medusa_lm_head.safetensors", "medusa_lm_head.pt"),
                     "eagle": ("pytorch_model.bin", "model.safetensors"), "eagle3": ("model.safetensors", "pytorch_model.bin")}


def to_reference(kind: str | None, export_dir: str | Path, out_dir: str | Path, weights_name: str | None = None) -> Path:
    """This project's export -> the reference layout of its kind (Medusa repository, EAGLE repository, SpecForge),
    written atomically into `out_dir`. `weights_name` picks the file (default: the first of REFERENCE_WEIGHTS[kind]);
    `.pt` / `.bin` are written with torch.save, `.safetensors` with safetensors. Returns `out_dir`."""
    export_dir = Path(export_dir).expanduser()
    config = _raw_config(export_dir)
    if not _is_project_export(config):
        raise UserError(f"{export_dir / CONFIG_NAME}: not a specdraft export (no verifier_fingerprint); it is already "
                        f"in a reference layout, or unknown.")
    found = export_kind(config)
    if found is None or (kind is not None and kind != found):
        raise UserError(f"{export_dir / CONFIG_NAME}: an export of kind {found!r}, asked for {kind!r}.")
    tensors = read_weights(export_dir)
    if found == "medusa":
        cfg, out = ref.medusa_to_reference(config, tensors, config.get("verifier_path"), export_dir / WEIGHTS_NAME)
    else:
        cfg, out = ref.eagle_to_reference(found, config, tensors)
    name = weights_name or REFERENCE_WEIGHTS[found][0]
    if name not in REFERENCE_WEIGHTS[found]:
        raise UserError(f"weights file {name!r} is not one the {KIND_NAMES[found]} reference reads; use one of "
                        f"{list(REFERENCE_WEIGHTS[found])}.")
    out = {k: v.contiguous() for k, v in out.items()}
    with atomic_dir(out_dir) as tmp:
        if name.endswith(".safetensors"):
            save_file(out, str(tmp / name), metadata={"format": "pt"})
        else:
            torch.save(out, tmp / name)
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return Path(out_dir)


# Keys of a flattened export config that save_export writes anew (the layer's and the formats' own).
REWRITTEN_KEYS = ("eagle_config", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "speculative_tokens",
                  "speculators_verifier", "converted_from")


def from_reference(ref_dir: str | Path, out_dir: str | Path, verifier: Verifier, served: str | None = None,
                   speculative_tokens: int | None = None) -> Path:
    """A reference-layout checkpoint (or an older export) -> this project's export for `verifier`, written by
    save_export (so it gets the fingerprint and every engine fix). Returns `out_dir`."""
    loaded = load_export(ref_dir, verifier)
    kept = {}
    if not loaded.config.get("reference_layout"):  # an older export: keep what training recorded in it
        net = loaded.net
        written = _medusa_config(net) if isinstance(net, MedusaHeads) else _eagle_config(net, verifier)
        regenerated = {*written, *_verifier_keys(verifier), *REWRITTEN_KEYS}
        kept = {k: v for k, v in loaded.config.items() if k not in regenerated}
    tokens = speculative_tokens or loaded.config.get("speculative_tokens") or spec.DEFAULT_SPECULATIVE_TOKENS
    return save_export(loaded.net, verifier, out_dir, kept | {"converted_from": str(ref_dir)},
                       target_counts=loaded.target_counts, speculative_tokens=int(tokens), served=served)

"""Export I/O for every drafter family with an export: write atomically, read the config and the weights, detect the
family, check the verifier, rebuild the network. What is each family's own (its config keys and their typed class,
tensor names, reference layout, speculators hooks) comes from its entry in models/families.py; nothing here names a
family.

An export is a directory an engine loads as it is: `config.json` and `model.safetensors`, and nothing else an
engine globs (vLLM loads every `*.safetensors` at the top of the folder). Its layout is the family's `ExportFormat`:
vLLM's own layout for a family it serves (Medusa's, EAGLE-1's Llama drafter), or, for a family with a
`speculators_type` (EAGLE-3, P-EAGLE, DFlash), the `speculators` format (models/exports/speculators.py), which
`vllm serve EXPORT_DIR` serves as it is.
Every config also carries this project's keys: `verifier` (the description `models.verifiers.load.load_verifier` takes),
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
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.exports import reference as ref
from models.exports import speculators as spec
from models.exports.folder import check_replaceable
from models.exports.folder import is_project_export as _is_project_export
from models.exports.shipped import check_manifest, expand
from models.families import FAMILIES, a_title, family_of_config, family_of_net, title
from models.formats.parts import LAYER_KEYS
from models.verifiers.core import Verifier, check_fingerprint
from models.verifiers.hf import from_file
from models.verifiers.load import EMBEDDED, verifier_source
from runtime.errors import UserError
from runtime.io import atomic_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SIDE_DIR = "specdraft"  # this project's side data, in a subfolder no engine reads
COUNTS_NAME = "target_counts.safetensors"  # training-target counts per verifier token (optional), in SIDE_DIR
ENGINE_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # what vLLM's loader globs at the folder's top


@dataclass
class Export:
    """A loaded export: its kind (a family of models/families.py with an export), the network, its config, and for
    a Medusa export that shares the verifier's head, the export's own copy of that head's weight."""

    kind: str
    net: nn.Module
    config: dict[str, Any]
    lm_head: Tensor | None = None
    target_counts: Tensor | None = None  # (V,) how often each verifier token was a training target (COUNTS_NAME)
    path: Path | None = None  # the directory it was read from

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
        raise UserError(f"checkpoint={str(path)!r}: no {CONFIG_NAME} there. Pass the `export/` directory train.py "
                        f"printed (or a Medusa / EAGLE reference checkpoint directory).")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_file} is not valid UTF-8 JSON ({e}); re-export the checkpoint.") from e
    if not isinstance(config, dict):
        raise UserError(f"{cfg_file} holds a JSON {type(config).__name__}, not an object of config keys; "
                        f"re-export the checkpoint.")
    return spec.flatten(config, str(cfg_file)) if spec.is_speculators(config) else config


def _load_tensors(file: Path) -> dict[str, Tensor]:
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise UserError(f"{file} is corrupt, truncated or not a plain tensor file ({e}); "
                        f"re-export the checkpoint.") from e
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise UserError(f"{file} is not a state dict of tensors; expected the reference layout's {file.name}.")
    return state


def _read_reference(path: Path, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A directory in one of the reference layouts, as this project's (config, tensors); an unknown layout refused."""
    weights = ref.reference_weights(path)
    if weights is None:
        raise UserError(f"checkpoint={str(path)!r}: {CONFIG_NAME} is not a specdraft export (no verifier_fingerprint, "
                        f"no model_type of an export family) and there is no weight file of a reference layout "
                        f"({', '.join(ref.reference_files())}).")
    tensors = _load_tensors(weights)
    kind = ref.layout_of(config, list(tensors))
    if kind is None:
        names = sorted(tensors)[:6]
        raise UserError(f"{weights}: unknown layout: not a specdraft export ({path / CONFIG_NAME} has no "
                        f"verifier_fingerprint; architectures={config.get('architectures')}) and its tensors {names} "
                        f"are none of the reference layouts (EAGLE-3: midlayer.*; EAGLE-1: fc.weight + layers.0.*; "
                        f"Medusa: medusa_lm_head.* with {{h}}.{{l}}.linear.*). Convert it with `python -m "
                        f"scripts.tools.convert` or pass an export train.py wrote.")
    return FAMILIES[kind].export.from_reference(config, tensors, weights)


def read_config(path: str | Path) -> dict[str, Any]:
    """An export's config.json, with a clear error for a missing or corrupt one. A reference-layout checkpoint
    (Medusa, EAGLE-1, EAGLE-3: models/exports/reference.py) is returned as this project's config, with
    `reference_layout` set and `verifier_path` taken from `base_model_name_or_path` when it has one."""
    path = Path(path).expanduser()
    config = _raw_config(path)
    return config if _is_project_export(config) else _read_reference(path, config)[0]


@dataclass(frozen=True)
class ExportInfo:
    """An export directory as read once, before any weight: its family (`kind`), its config, the verifier it names
    and its acceptance estimates. `load_export(info, verifier)` then reads the weights."""

    path: Path
    kind: str
    config: dict[str, Any]

    @property
    def verifier(self) -> dict[str, Any] | None:
        """The verifier description the export stores (export_verifier), or None."""
        return export_verifier(self.config, self.path / CONFIG_NAME)

    @property
    def acceptance(self) -> list[list[float]] | None:
        """Its acceptance estimates as a cumulative top-k table, one row per depth, from the first of its family's
        `acceptance` keys the config has (a per-depth list of top-1 rates is read as a chain: one rank per depth,
        nothing on siblings); None when it records none."""
        return acceptance_table(self.config, self.kind)

    @property
    def speculative_tokens(self) -> int | None:
        """The chain an engine drafts when it serves the export as it is (speculators format), or None."""
        return self.config.get("speculative_tokens")


def acceptance_table(config: dict[str, Any], kind: str) -> list[list[float]] | None:
    """An export config's acceptance estimates as a cumulative top-k table, one row per depth, from the first of
    family `kind`'s `acceptance` keys it has (a per-depth list of top-1 rates is read as a chain: one rank per depth,
    nothing on siblings); None when it records none."""
    for key in FAMILIES[kind].acceptance:
        value = config.get(key)
        if value:
            return [list(row) if isinstance(row, (list, tuple)) else [float(row)] for row in value]
    return None


def read_info(path: str | Path | ExportInfo) -> ExportInfo:
    """The export at `path` (config.json read once; a reference layout's converted), refusing a directory that holds
    no family's export, or a shipped one whose files differ from its manifest (before any verifier loads)."""
    if isinstance(path, ExportInfo):
        return path
    path = Path(path).expanduser()
    check_manifest(path)
    config = read_config(path)
    kind = export_kind(config)
    if kind is None:
        known = sorted(a for f in FAMILIES.values() if f.export for a in f.export.architectures + f.export.reads)
        raise UserError(f"{path / CONFIG_NAME}: model_type={config.get('model_type')!r}, architectures="
                        f"{config.get('architectures')}: no drafter family's export (expected architectures naming "
                        f"one of {known}, or model_type 'medusa').")
    if _is_project_export(config) and (path / WEIGHTS_NAME).is_file():
        check_weights_agree(kind, config, header_shapes(path / WEIGHTS_NAME), path / CONFIG_NAME,
                            spec.is_speculators(json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))))
    return ExportInfo(path, kind, config)


def header_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's header alone (no tensor is read)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise UserError(f"{file} is corrupt, truncated or not a safetensors file ({e}); re-export the "
                        f"checkpoint.") from e


def check_weights_agree(kind: str, config: dict[str, Any], shapes: dict[str, list[int]], file: Path,
                        speculators: bool) -> None:
    """Refuse an export whose config.json disagrees with its weights (the family's `agrees`, models/families.py:
    layers, hidden and intermediate sizes, heads, feature layers, draft vocabulary), naming the field and the tensor
    with its shape: an engine builds the drafter from the config, so such an export would run other weights than
    the ones trained (a layer left uninitialised, a head cut short). `speculators`: the layer's fields sit in
    transformer_layer_config."""
    check = FAMILIES[kind].export.agrees
    for d in check(config, shapes) if check is not None else []:
        field = f"transformer_layer_config.{d.field}" if speculators and d.field in LAYER_KEYS else d.field
        held = f"{d.tensor} of shape {d.shape}" if isinstance(d.shape, list) else f"{d.tensor} ({d.shape})"
        raise UserError(f"{file}: {field}={d.value!r} disagrees with the weights: {WEIGHTS_NAME} holds {held}, "
                        f"where {field}={d.value!r} means {d.expected}. An engine builds the drafter from "
                        f"the config, so it would not run the trained weights: restore this export's own "
                        f"{CONFIG_NAME} (copy the export again, or re-export it), or set {field} to match.")


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """An export's tensors by this project's names (a reference layout's renamed)."""
    path = Path(path).expanduser()
    config = _raw_config(path)
    if not _is_project_export(config):
        return _read_reference(path, config)[1]
    return _project_weights(path)


def _project_weights(path: Path) -> dict[str, Tensor]:
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise UserError(f"checkpoint={str(path)!r}: {WEIGHTS_NAME} is missing. Re-export it "
                        f"(train.py writes it on fit end).")
    return _load_tensors(weights)


def export_kind(config: dict[str, Any]) -> str | None:
    """The family an export's config holds (models.families.family_of_config); None if it is none of them."""
    return family_of_config(config)


def export_verifier(config: dict[str, Any], file: str | Path | None = None) -> dict[str, Any] | None:
    """The verifier description an export stores (older exports: the `verifier_path` string), or None. Named by a
    file, not by the user, it loads from this machine only and never with the checkpoint's own code
    (models.verifiers.hf.from_file): a user who trusts it passes it themselves (verifier_path=, --verifier). `file`:
    the config.json it was read from, for messages."""
    if config.get("verifier"):
        where = f"{file}: `verifier`" if file is not None else "the export's config.json `verifier`"
        return from_file(verifier_source(config["verifier"], where), "the export's config.json `verifier`")
    if config.get("verifier_path"):
        return from_file(verifier_source(str(config["verifier_path"])), "the export's config.json `verifier_path`")
    return None


def load_export(path: str | Path | ExportInfo, verifier: Verifier, kind: str | None = None) -> Export:
    """Rebuild the drafter an export holds (a directory, or its ExportInfo already read), refusing one of another
    kind than `kind` (when given) or one made for another verifier. A reference-layout checkpoint
    (models/exports/reference.py) loads too; having no fingerprint, it is checked against the verifier by shape
    only. A shipped export's files are checked against its manifest first (models.exports.shipped.check_manifest)."""
    check_manifest(path.path if isinstance(path, ExportInfo) else path)
    info = read_info(path)
    path, found, config = info.path, info.kind, dict(info.config)
    if kind is not None and found != kind:
        raise UserError(f"checkpoint={str(path)!r} is {a_title(found)} export but was given as {title(kind)}. Use "
                        f"drafter={found} for it, or pass {a_title(kind)} export.")
    reference = bool(config.get("reference_layout"))  # names no verifier: the one given is trusted
    if not reference:
        if not isinstance(config.get("verifier_fingerprint"), dict) or not config["verifier_fingerprint"]:
            raise UserError(f"{path / CONFIG_NAME} has no verifier_fingerprint, so it cannot be checked against the "
                            f"verifier it is used with. Re-export it with this toolkit (train.py), or convert a "
                            f"reference-format checkpoint with `python -m scripts.tools.convert`.")
        check_fingerprint(config["verifier_fingerprint"], verifier, f"{title(found)} export {str(path)!r}")
        if [f for f in stray_weight_files(path) if f.name != COUNTS_NAME]:
            check_engine_ready(path)  # a stray weight file: refused with its name and the fix
        if (path / COUNTS_NAME).is_file():  # written before the side data moved: loads here, vLLM refuses it
            warnings.warn(f"{path / COUNTS_NAME}: this export was written before side data moved to {SIDE_DIR}/; it "
                          f"loads here, but vLLM refuses the folder. Rewrite it: python -m scripts.tools.convert "
                          f"from-reference {path} <new dir>.", stacklevel=2)
    tensors = _read_reference(path, _raw_config(path))[1] if reference else _project_weights(path)
    if not reference:  # a compact (shipped) export: the verifier's own tensors put back, dtypes restored
        tensors = expand(_raw_config(path), tensors, verifier, path / WEIGHTS_NAME)
    net, lm_head = FAMILIES[found].export.read(config, tensors, verifier, path / WEIGHTS_NAME, reference)
    counts = read_target_counts(path, int(verifier.vocab_size))
    return Export(found, net.eval().requires_grad_(False), config, lm_head, counts, path)


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
    path = verifier.source.get("path") if loader == "hf" else loader if loader in EMBEDDED else verifier.name
    return {"verifier": verifier.source, "verifier_path": path, "verifier_fingerprint": verifier.fingerprint}


def served_verifier(verifier: Verifier) -> str:
    """What an engine serving the export loads as its verifier: the verifier's checkpoint (a local directory or a
    Hub id), else its display name (a verifier built in memory: `models.verifiers.hf.save_checkpoint` writes one)."""
    return verifier.checkpoint or verifier.name


def save_export(net: nn.Module, verifier: Verifier, path: str | Path,
                extra: dict[str, Any] | None = None, target_counts: Tensor | None = None,
                speculative_tokens: int | None = None, served: str | None = None, force: bool = False) -> Path:
    """Write `config.json` + `model.safetensors` for the network of a family with an export (models/families.py),
    atomically. Returns the directory. A folder holding anything but an export of the same family is refused
    (check_replaceable) unless `force`.
    `target_counts` (V,): how often each verifier token was a training target, written as `SIDE_DIR/COUNTS_NAME`
    (the decoder's `draft_vocab` reads it; no engine looks there). An EAGLE-3 export is in the speculators format:
    `speculative_tokens` is the chain vLLM drafts when it serves the folder as it is (default: a parallel
    drafter's K, else 3), and `served` (default:
    `served_verifier(verifier)`) the verifier it loads."""
    kind = family_of_net(net)
    check_replaceable(path, kind, "export", force)
    fmt = _format(kind)
    layout, tensors = fmt.write(net, verifier)
    config = {"architectures": list(fmt.architectures), **layout} | _verifier_keys(verifier) | (extra or {})
    flat = config
    if fmt.speculators_type is not None:
        architectures = list(getattr(verifier.config, "architectures", None) or [type(verifier.model).__name__])
        if speculative_tokens is None:  # a parallel drafter's K, else the default chain
            speculative_tokens = int(getattr(net, "parallel", spec.DEFAULT_SPECULATIVE_TOKENS))
        config = spec.to_speculators(config, fmt.speculators_type, served or served_verifier(verifier),
                                     architectures, speculative_tokens)
    shapes = {name: list(t.shape) for name, t in tensors.items()}
    check_weights_agree(kind, flat, shapes, Path(path) / CONFIG_NAME, speculators=False)
    for d in fmt.engine_reads(config, shapes) if fmt.engine_reads is not None else []:
        raise UserError(f"{Path(path) / CONFIG_NAME}: vLLM would not serve this {title(kind)} export: {d.field}="
                        f"{d.value!r} but {d.tensor} is {d.shape}: {d.expected}. Nothing was written; this is a "
                        f"writer bug, or a setting the engine cannot serve (docs/engine_loaders.md).")
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
        fix = (f"an export written before the side data moved to {SIDE_DIR}/: rewrite it with `python -m "
               f"scripts.tools.convert from-reference {path} <new dir>` (or move the file to "
               f"{path / SIDE_DIR / f.name})"
               if legacy else f"move it out of the folder (this toolkit keeps side data in {SIDE_DIR}/)")
        raise UserError(f"{f}: a weight file beside {WEIGHTS_NAME}. vLLM loads every *.safetensors in an export "
                        f"folder and refuses tensors its drafter has no parameter for, so it would not serve "
                        f"{path}: {fix}.")


# -- the reference layouts (models/exports/reference.py), both ways ----------------------------------------------------

def _format(name: str) -> Any:
    """The export format of family `name` (models/families.py)."""
    fmt = FAMILIES[name].export
    if fmt is None:
        raise UserError(f"the {title(name)} family has no export format (models/families.py).")
    return fmt


def to_reference(kind: str | None, export_dir: str | Path, out_dir: str | Path, weights_name: str | None = None,
                 force: bool = False) -> Path:
    """This project's export -> the reference layout of its kind (Medusa repository, EAGLE repository, SpecForge),
    written atomically into `out_dir`. `weights_name` picks the file (default: the first its family's
    `reference_weights` names);
    `.pt` / `.bin` are written with torch.save, `.safetensors` with safetensors. Returns `out_dir`. A folder holding
    anything but a reference layout of the same family is refused (check_replaceable) unless `force`."""
    export_dir = Path(export_dir).expanduser()
    config = _raw_config(export_dir)
    if not _is_project_export(config):
        raise UserError(f"{export_dir / CONFIG_NAME}: not a specdraft export (no verifier_fingerprint); it is already "
                        f"in a reference layout, or unknown.")
    found = export_kind(config)
    if found is None or (kind is not None and kind != found):
        raise UserError(f"{export_dir / CONFIG_NAME}: an export of kind {found!r}, asked for {kind!r}.")
    fmt = _format(found)
    tensors = read_weights(export_dir)
    cfg, out = fmt.to_reference(config, tensors, config.get("verifier_path"), export_dir / WEIGHTS_NAME)
    name = weights_name or fmt.reference_weights[0]
    if name not in fmt.reference_weights:
        raise UserError(f"weights file {name!r} is not one the {title(found)} reference reads; use one of "
                        f"{list(fmt.reference_weights)}.")
    out = {k: v.contiguous() for k, v in out.items()}
    check_replaceable(out_dir, found, "reference", force)
    with atomic_dir(out_dir) as tmp:
        if name.endswith(".safetensors"):
            save_file(out, str(tmp / name), metadata={"format": "pt"})
        else:
            torch.save(out, tmp / name)
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return Path(out_dir)


def check_speculative_tokens(value: Any, setting: str) -> None:
    """A chain length an engine drafts (`setting` names the option in the message): None (the default) or >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"{setting}={value!r}: the tokens vLLM drafts per step must be a whole number >= 1 (0 would "
                        f"draft nothing); give e.g. {spec.DEFAULT_SPECULATIVE_TOKENS}, or leave it out for the "
                        f"export's own (else {spec.DEFAULT_SPECULATIVE_TOKENS}).")


# Keys of a flattened export config that save_export writes anew (the layer's and the formats' own).
REWRITTEN_KEYS = ("eagle_config", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "speculative_tokens",
                  "speculators_verifier", "converted_from", "num_aux_hidden_states")


def from_reference(ref_dir: str | Path, out_dir: str | Path, verifier: Verifier, served: str | None = None,
                   speculative_tokens: int | None = None, force: bool = False) -> Path:
    """A reference-layout checkpoint (or an older export) -> this project's export for `verifier`, written by
    save_export (so it gets the fingerprint and every engine fix). Returns `out_dir`. A folder holding anything but
    an export of the same family is refused (check_replaceable) unless `force`."""
    check_speculative_tokens(speculative_tokens, "speculative_tokens")
    loaded = load_export(ref_dir, verifier)
    check_replaceable(out_dir, loaded.kind, "export", force)  # before converting, as save_export checks again
    kept = {}
    if not loaded.config.get("reference_layout"):  # an older export: keep what training recorded in it
        written = {"architectures": None, **_format(loaded.kind).write(loaded.net, verifier)[0]}
        regenerated = {*written, *_verifier_keys(verifier), *REWRITTEN_KEYS}
        kept = {k: v for k, v in loaded.config.items() if k not in regenerated}
    tokens = speculative_tokens or loaded.config.get("speculative_tokens") or spec.DEFAULT_SPECULATIVE_TOKENS
    return save_export(loaded.net, verifier, out_dir, kept | {"converted_from": str(ref_dir)},
                       target_counts=loaded.target_counts, speculative_tokens=int(tokens), served=served,
                       force=force)

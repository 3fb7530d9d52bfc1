"""Exports that ship in the repository (pretrained/<name>/): an export made compact, and the engine-ready folder
written back from it on demand.

A compact export is an ordinary export folder (config.json, model.safetensors, specdraft/ side data) with two
differences, recorded in config.json under `specdraft_compact`:
- tensors that are a copy of the verifier's own (Medusa's shared vocabulary head) are left out, and named with
  where they come from (`verifier.lm_head`); the verifier's fingerprint, checked on load, guarantees the same bits;
- floating-point tensors are stored in bfloat16, their original dtypes recorded.
`load_export` reads it as it is (`expand` puts the left-out tensors back and restores the dtypes), so
`python -m eval checkpoint=pretrained/<name>` works; `python -m scripts.tools.convert engine-ready pretrained/<name>
OUT` writes the folder an engine loads (vLLM refuses the compact one: a tensor is missing).

Beside the side data, a shipped export carries what made it: `specdraft/recipe.yaml` (the run's config),
`specdraft/training.json` (its training figures) and `specdraft/eval_report.json` (its eval report), where given.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from models.exports.folder import COMPACT_KEY, check_replaceable
from models.families import family_of_config
from models.verifiers.core import check_fingerprint
from runtime.errors import UserError
from runtime.io import atomic_dir

CONFIG_NAME, WEIGHTS_NAME, SIDE_DIR = "config.json", "model.safetensors", "specdraft"
# Where a left-out tensor comes from: a name, and how to take it from the verifier.
SHARED: dict[str, Callable[[Any], Tensor]] = {
    "verifier.lm_head": lambda verifier: verifier.lm_head.weight,
}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"{COMPACT_KEY}: unknown dtype {name!r} in the export's config.json; re-ship the export.")
    return dtype


def compact_tensors(tensors: dict[str, Tensor], verifier: Any,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors to store and the `specdraft_compact` record: copies of the verifier's own tensors left out,
    floating-point ones cast to `dtype`."""
    shared = {source: get(verifier).detach().cpu() for source, get in SHARED.items()}
    kept, dropped, dtypes = {}, {}, {}
    for name, t in tensors.items():
        # A copy of the verifier's tensor, as the export stores it (cast to its serving dtype): `expand` casts the
        # verifier's tensor to the recorded dtype, which gives these bits back.
        source = next((s for s, v in shared.items() if v.shape == t.shape and torch.equal(v.to(t.dtype), t)), None)
        dtypes[name] = str(t.dtype).removeprefix("torch.")
        if source is not None:
            dropped[name] = source
        else:
            kept[name] = t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()
    return kept, {"dropped": dropped, "dtypes": dtypes, "stored_dtype": str(dtype).removeprefix("torch.")}


def expand(config: dict[str, Any], tensors: dict[str, Tensor], verifier: Any, where: Path) -> dict[str, Tensor]:
    """A compact export's tensors as the full export had them: left-out ones taken from the verifier, every tensor
    in its recorded dtype. Tensors of a full export come back as they are."""
    record = config.get(COMPACT_KEY)
    if not record:
        return tensors
    out = dict(tensors)
    for name, source in record.get("dropped", {}).items():
        if source not in SHARED:
            raise UserError(f"{where}: {COMPACT_KEY} leaves out {name} as {source!r}, which this toolkit does not "
                            f"know (it knows {sorted(SHARED)}). Use the toolkit version that shipped it.")
        out[name] = SHARED[source](verifier).detach().cpu()
    missing = sorted(set(record.get("dtypes", {})) - set(out))
    if missing:
        raise UserError(f"{where}: the compact export lacks {missing}, which its config.json records. The folder is "
                        f"damaged: restore it (git checkout -- {where.parent}).")
    return {k: v.to(_dtype(record["dtypes"].get(k, str(v.dtype)))).contiguous() for k, v in out.items()}


def ship(export_dir: str | Path, out_dir: str | Path, verifier: Any, extras: dict[str, Path | None] | None = None,
         dtype: torch.dtype = torch.bfloat16, force: bool = False) -> Path:
    """Write the compact form of the export in `export_dir` into `out_dir` (atomically): its side data and, from
    `extras` (file name under specdraft/ -> source file), the recipe, training figures and eval report. A folder
    holding anything but a compact export of the same family is refused unless `force`."""
    src = Path(export_dir).expanduser()
    config = json.loads((src / CONFIG_NAME).read_text())
    if config.get(COMPACT_KEY):
        raise UserError(f"{src} is already compact; ship an export written by train.py.")
    check_replaceable(out_dir, family_of_config(config), "compact", force)
    kept, record = compact_tensors(load_file(str(src / WEIGHTS_NAME)), verifier, dtype)
    config[COMPACT_KEY] = record
    with atomic_dir(out_dir) as tmp:
        if (src / SIDE_DIR).is_dir():
            shutil.copytree(src / SIDE_DIR, tmp / SIDE_DIR, ignore=_no_manifest)
        (tmp / SIDE_DIR).mkdir(exist_ok=True)
        for name, file in (extras or {}).items():
            if file is not None:
                shutil.copyfile(file, tmp / SIDE_DIR / name)
        save_file(kept, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        (tmp / MANIFEST).write_text(json.dumps(file_manifest(tmp), indent=2))
    return Path(out_dir)


MANIFEST = f"{SIDE_DIR}/manifest.json"  # every other file of a shipped export: its size and sha256


def file_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes", "sha256"}} of every file in a shipped export but the manifest itself."""
    import hashlib

    return {f.relative_to(folder).as_posix(): {"bytes": f.stat().st_size,
                                               "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
            for f in sorted(folder.rglob("*")) if f.is_file() and f.relative_to(folder).as_posix() != MANIFEST}


def _no_manifest(directory: str, names: list[str]) -> list[str]:
    """copytree's `ignore` for a SIDE_DIR copy: leave the manifest out (it lists the files of the folder it is in)."""
    return [n for n in names if Path(directory).name == SIDE_DIR and f"{SIDE_DIR}/{n}" == MANIFEST]


def check_manifest(folder: str | Path) -> None:
    """Refuse a shipped export whose files are not the ones its manifest (MANIFEST, written by `ship`) lists: a file
    missing, or of another size or sha256, named with the fix. A folder without a manifest passes."""
    import hashlib

    folder = Path(folder).expanduser()
    file = folder / MANIFEST
    if not file.is_file():
        return
    fix = (f"Restore it (git checkout -- {folder}, for a drafter that ships in the repository) or ship it again "
           f"(python -m scripts.tools.convert ship <the export it was shipped from> {folder})")
    try:
        listed = json.loads(file.read_text(encoding="utf-8"))
        items = [(str(name), int(rec["bytes"]), str(rec["sha256"])) for name, rec in listed.items()]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"{file} is damaged ({type(e).__name__}: {e}), so the export's files cannot be checked. "
                        f"{fix}.") from e
    for name, size, sha in items:
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path} is missing but {file} lists it: the shipped export is damaged. {fix}.")
        seen = path.stat().st_size
        if seen != size:
            raise UserError(f"{path} has {seen} bytes but {file} records {size}: the file is damaged or was changed "
                            f"after shipping. {fix}.")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != sha:
            raise UserError(f"{path}: sha256 {digest.hexdigest()[:16]}... but {file} records {sha[:16]}...: the file "
                            f"is damaged or was changed after shipping. {fix}.")


def engine_ready(shipped_dir: str | Path, out_dir: str | Path, verifier: Any, force: bool = False) -> Path:
    """The folder an engine loads, written from a compact export (the left-out tensors put back, the recorded
    dtypes restored; config.json without the compact record, naming `verifier`'s checkpoint on this machine as the
    verifier vLLM loads; no manifest). The verifier must be the one the export names (its fingerprint is checked),
    its files the ones its manifest lists. A folder holding anything but an
    export of the same family is refused unless `force`."""
    src = Path(shipped_dir).expanduser()
    check_manifest(src)
    config = json.loads((src / CONFIG_NAME).read_text())
    if not config.get(COMPACT_KEY):
        raise UserError(f"{src} is not a compact export (no {COMPACT_KEY} in its config.json): it is engine-ready "
                        f"as it is.")
    check_replaceable(out_dir, family_of_config(config), "export", force)
    check_fingerprint(config["verifier_fingerprint"], verifier, f"shipped export {str(src)!r}")
    tensors = expand(config, load_file(str(src / WEIGHTS_NAME)), verifier, src / WEIGHTS_NAME)
    del config[COMPACT_KEY]
    named = config.get("speculators_config", {}).get("verifier")
    if isinstance(named, dict) and verifier.checkpoint:  # vLLM loads the verifier from here: this machine's copy
        named["name_or_path"] = str(verifier.checkpoint)
    with atomic_dir(out_dir) as tmp:
        if (src / SIDE_DIR).is_dir():
            shutil.copytree(src / SIDE_DIR, tmp / SIDE_DIR, ignore=_no_manifest)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return Path(out_dir)

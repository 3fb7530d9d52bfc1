"""What an existing folder holds, before a writer replaces it whole (runtime.io.atomic_dir): every export writer
(models/exports/io.py, models/exports/shipped.py) calls `check_replaceable` first, so a folder holding anything
but an
export of the same family and layout is refused instead of deleted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from models.exports import reference as ref
from models.exports import speculators as spec
from models.families import FAMILIES, a_title, family_of_config
from runtime.errors import UserError

CONFIG_NAME, WEIGHTS_NAME, SIDE_DIR = "config.json", "model.safetensors", "specdraft"
COUNTS_NAME = "target_counts.safetensors"  # older exports kept it beside the weights
COMPACT_KEY = "specdraft_compact"  # a compact (shipped) export's record in config.json (models/exports/shipped.py)
# The layouts a folder can hold, for messages: this project's export, its compact (shipped) form, a reference layout.
LAYOUTS = {"export": "export", "compact": "compact (shipped) export", "reference": "reference-layout checkpoint"}


def is_project_export(config: dict[str, Any]) -> bool:
    """Written by this toolkit (a fingerprint, or a layout only it writes), not a reference repository's checkpoint."""
    return "verifier_fingerprint" in config or "eagle_kind" in config or any(
        f.export.model_type is not None and config.get("model_type") == f.export.model_type
        for f in FAMILIES.values() if f.export is not None)


def _tensor_names(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    state = torch.load(file, map_location="cpu", weights_only=True)
    return list(state) if isinstance(state, dict) else []


def folder_layout(path: str | Path) -> tuple[str | None, str | None]:
    """(family, layout) of the export an existing folder holds (layout: a key of LAYOUTS), or (None, None) when it
    holds none this toolkit reads."""
    path = Path(path).expanduser()
    try:
        config = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            return None, None
        if spec.is_speculators(config):
            config = spec.flatten(config, str(path / CONFIG_NAME))
        if is_project_export(config):
            return family_of_config(config), "compact" if config.get(COMPACT_KEY) else "export"
        weights = ref.reference_weights(path)
        return (ref.layout_of(config, _tensor_names(weights)), "reference") if weights else (None, None)
    except Exception:  # anything unreadable (bad JSON, a damaged weight file) is no export this toolkit reads
        return None, None


def check_replaceable(out_dir: str | Path, kind: str, layout: str, force: bool = False) -> None:
    """Refuse to write a `layout` export of family `kind` into `out_dir` (which every writer replaces whole) when the
    folder holds anything else: a file, a non-empty folder that is not an export of the same family and layout, or
    files beside the export that the new one would not have. `force` replaces it all the same."""
    out = Path(out_dir).expanduser()
    if force or not out.exists() and not out.is_symlink():
        return
    fix = (f"Write to a new or empty folder, move what {out} holds elsewhere first, or pass --force "
           f"(python -m scripts.tools.convert) to replace it")
    if not out.is_dir():
        raise UserError(f"{out} is not a folder, and writing {a_title(kind)} {LAYOUTS[layout]} there would "
                        f"delete it. {fix}.")
    entries = sorted(out.iterdir())
    if not entries:
        return
    found, found_layout = folder_layout(out)
    if (found, found_layout) != (kind, layout):
        what = (f"{a_title(found)} {LAYOUTS[found_layout]}" if found is not None
                else f"no export but {', '.join(e.name for e in entries[:4])}"
                     f"{f' and {len(entries) - 4} more' if len(entries) > 4 else ''}")
        raise UserError(f"{out} holds {what}; writing {a_title(kind)} {LAYOUTS[layout]} there would replace the "
                        f"whole folder and delete it. {fix}.")
    known = {CONFIG_NAME, WEIGHTS_NAME, COUNTS_NAME, SIDE_DIR, *ref.reference_files()}
    foreign = [e.name for e in entries if e.name not in known]
    if foreign:
        raise UserError(f"{out} holds {a_title(kind)} {LAYOUTS[layout]} and also {foreign}, which the new one would "
                        f"not have: writing there would replace the whole folder and delete them. {fix}.")

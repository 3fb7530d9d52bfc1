"""The public reference layouts, read into and written from this project's export layout (docs/engine_loaders.md,
"Reference layouts"). Pure functions over (config dict, tensor dict); models/exports/io.py does the file I/O.

- `medusa`: FasterDecoding/Medusa: `config.json` {medusa_num_heads, medusa_num_layers, base_model_name_or_path} +
  `medusa_lm_head.safetensors` or `.pt`; keys `{h}.{l}.linear.weight|bias`, `{h}.{L}.weight` (the Medusa-2 file
  has no `{h}.{L}.weight`: the base model's lm_head is shared). Only medusa_num_layers = 1 maps (the reference's
  `[ResBlock] * L` is one block repeated).
- `eagle`: SafeAILab/EAGLE EAGLE-1: Llama config + `pytorch_model.bin` / `model.safetensors` with `fc.weight`,
  `fc.bias`, `layers.0.*` (maybe `embed_tokens.weight`, dropped: the verifier's is used).
- `eagle3`: SpecForge / EAGLE repository EAGLE-3: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`; layer ids,
  if any, in `eagle_config.eagle_aux_hidden_state_layer_ids` in SGLang's convention (id k = output of layer k, i.e.
  this project's k + 1); none = the engines' default [2, L//2, L-3] in this project's convention.

Each layout is its family's own (models/medusa.py, models/formats/eagle.py), reached through the registry entry's
`is_reference`, `from_reference` and `to_reference` (models/families.py); this module finds the layout of a folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.families import FAMILIES


def reference_files() -> tuple[str, ...]:
    """Every family's reference weight file names (its registry entry's `reference_weights`), in registry order, each
    once: a name only one family writes (Medusa's `medusa_lm_head.*`) comes before the ones several share."""
    names: list[str] = []
    for fam in FAMILIES.values():
        for name in fam.export.reference_weights if fam.export is not None else ():
            if name not in names:
                names.append(name)
    return tuple(names)


def reference_weights(path: Path) -> Path | None:
    """The weight file of a reference layout in folder `path`, or None."""
    return next((path / f for f in reference_files() if (path / f).is_file()), None)


def layout_of(config: dict[str, Any], names: list[str]) -> str | None:
    """The family whose reference layout `config` and the weight file's tensor names `names` are (its registry
    entry's `is_reference`), or None if they are none of them."""
    return next((name for name, fam in FAMILIES.items()
                 if fam.export is not None and fam.export.is_reference is not None
                 and fam.export.is_reference(config, names)), None)

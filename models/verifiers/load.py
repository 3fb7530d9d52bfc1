"""The verifier from a description (`load_verifier`): the loaders by name, as an export's `verifier`
entry and the command line name them.
"""

from __future__ import annotations

import inspect
from typing import Any

from models.verifiers.core import Verifier
from models.verifiers.embedded import load_gemma3, load_smollm2
from models.verifiers.hf import load_hf
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError

LOADERS = {"smollm2": load_smollm2, "gemma3": load_gemma3, "hf": load_hf, "tiny": build_tiny}
EMBEDDED = ("smollm2", "gemma3")  # verifiers named by their loader alone


# What the caller of a loader gives (load_verifier's own arguments), never a description.
_GIVEN = ("cache_dir", "dtype", "device")


def verifier_source(value: str | dict[str, Any], where: str = "verifier description") -> dict[str, Any]:
    """A verifier description from the command line or an export: a dict as stored (`{"loader": ..., ...}`), or a
    string: `smollm2` or `gemma3` (the embedded verifiers), else a Hugging Face Hub id or local checkpoint directory.
    A dict's keys are checked against its loader's arguments (`where` names the description in the message)."""
    if isinstance(value, dict):
        if value.get("loader") not in LOADERS:
            raise UserError(f"verifier description {value!r} names no known loader; expected one of {sorted(LOADERS)}.")
        takes = [k for k in inspect.signature(LOADERS[value["loader"]]).parameters if k not in _GIVEN]
        unknown = [k for k in value if k != "loader" and k not in takes]
        if unknown:
            fix = ("Remove it from verifier_path= (python -m eval) or --verifier (scripts.tools.convert)"
                   if where == "verifier description" else "Remove it from that entry, or write the file again with "
                                                            "this version (re-export the drafter)")
            raise UserError(f"{where} {value!r}: the {value['loader']!r} loader takes no key {unknown[0]!r}"
                            f"{f' (nor {unknown[1:]})' if len(unknown) > 1 else ''}; the keys allowed are loader, "
                            f"{', '.join(takes)}. {fix}.")
        return dict(value)
    if not isinstance(value, str) or not value:
        raise UserError(f"verifier {value!r} is not a verifier description: give `smollm2`, `gemma3`, a Hub id or a "
                        f"local checkpoint directory.")
    return {"loader": value} if value in EMBEDDED else {"loader": "hf", "path": value}


def load_verifier(source: str | dict[str, Any], dtype: str = "float32", device: str = "auto",
                  cache_dir: str | None = None) -> Verifier:
    """Load the verifier a description names (see `verifier_source`) in `dtype` on `device`."""
    spec = verifier_source(source)
    args = {k: v for k, v in spec.items() if k != "loader"}
    if spec["loader"] == "hf":
        return load_hf(dtype=dtype, device=device, **args)
    return LOADERS[spec["loader"]](cache_dir=cache_dir, dtype=dtype, device=device, **args)

"""The `speculators` format: the vLLM project's native drafter config, which `vllm serve EXPORT_DIR` reads as the
model itself (the verifier and the number of speculative tokens come from the export; no --speculative-config).

One config.json with three parts, as vLLM 0.32 reads it (`vllm/transformers_utils/configs/speculators/`):
- `speculators_model_type` (the algorithm vLLM registers: `eagle3`, `peagle` or `dflash` here) and its keys
  (`draft_vocab_size`, `norm_before_residual`, ..., `eagle_aux_hidden_state_layer_ids`);
- `transformer_layer_config`: the drafter's own layer, as a Hugging Face config dict;
- `speculators_config`: `algorithm`, `proposal_methods` (`speculative_tokens`, ...), `default_proposal_method`
  and `verifier` (`name_or_path`, `architectures`): vLLM loads the verifier from `name_or_path`, so it must
  resolve where the export is served (a local directory offline, or a Hub id).

This project's own keys (the verifier description and fingerprint, accuracy tables) stay at the top level, where
vLLM keeps them as plain attributes and reads nothing from them. `flatten` turns such a config into the flat one the
rest of the project reads (the layout the older EAGLE-3 exports have), so one reader serves both.

What each algorithm writes and checks is its family's own (models/formats/eagle.py for eagle3 and peagle,
models/dflash.py for dflash), reached through the registry entry's `to_speculators` / `from_speculators`
(models/families.py); they build on the parts the format shares (models/formats/parts.py), and this module finds the
family by `speculators_model_type`.
"""

from __future__ import annotations

from typing import Any

from models.families import FAMILIES
from runtime.errors import UserError

DEFAULT_SPECULATIVE_TOKENS = 3


def _families() -> dict[str, str]:
    """speculators_model_type -> the family whose export is written in it (models/families.py)."""
    return {f.export.speculators_type: n for n, f in FAMILIES.items()
            if f.export is not None and f.export.speculators_type is not None}


def _format(algorithm: Any) -> tuple[str | None, Any]:
    """(family name, its ExportFormat) for a speculators_model_type, or None's when no family writes it."""
    name = _families().get(algorithm) if isinstance(algorithm, str) else None
    return (name, FAMILIES[name].export) if name is not None else (None, None)


def is_speculators(config: dict[str, Any]) -> bool:
    return "speculators_model_type" in config or "speculators_config" in config


def to_speculators(flat: dict[str, Any], algorithm: str, verifier_name_or_path: str,
                   verifier_architectures: list[str],
                   speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> dict[str, Any]:
    """A flat export config (the family's layout plus this project's keys) in the speculators format as `algorithm`
    (the family's `speculators_type`), written by that family's `to_speculators`. `speculative_tokens`: the chain
    length vLLM drafts when it serves the export as it is."""
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise UserError(f"speculative_tokens={speculative_tokens!r}: give a whole number >= 1 (the tokens vLLM drafts "
                        f"per step when it serves the export).")
    _, fmt = _format(algorithm)
    if fmt is None:
        raise UserError(f"speculators_model_type={algorithm!r}: no family writes it; this toolkit writes the "
                        f"speculators format for {sorted(_families())} (models/families.py).")
    return fmt.to_speculators(flat, algorithm, verifier_name_or_path, verifier_architectures, speculative_tokens)


def flatten(config: dict[str, Any], file: str = "config.json") -> dict[str, Any]:
    """A speculators-format config as this project's flat config of its family (read by that family's
    `from_speculators`), every field vLLM needs checked first: one message per problem, naming the key and the fix."""
    algo = config.get("speculators_model_type")
    name, fmt = _format(algo)
    if fmt is None:
        raise UserError(f"{file}: speculators_model_type={algo!r}: this toolkit reads the speculators format for "
                        f"{sorted(_families())}. Export the drafter with this toolkit, or convert it "
                        f"with `python -m scripts.tools.convert`.")
    return fmt.from_speculators(config, file, name, fmt.architectures[0])

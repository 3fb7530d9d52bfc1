"""P-EAGLE's export layout (vLLM's `peagle` speculators type): EAGLE-3's
(models/formats/eagle.py) plus the mask slots' feature and K.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from models.eagle import layer_config
from models.formats.eagle import (
    Eagle3Config,
    aux_layer_ids,
    check_draft_layer,
    check_draft_vocab,
    draft_layer_config,
    eagle3_keys,
    eagle_from_speculators,
    eagle_layout,
)
from runtime.errors import UserError
from runtime.io import load_state


@dataclass(frozen=True, kw_only=True)
class PEagleConfig(Eagle3Config):
    """A P-EAGLE export's own config.json keys: EAGLE-3's, its mask token and K."""

    mask_token_id: int = field(metadata={"help": "the token each parallel draft slot is embedded as", "min": 0})
    parallel_tokens: int = field(default=4, metadata={"help": "K, the drafts one forward makes", "min": 1})


def peagle_layout(net: Any, verifier: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """P-EAGLE's export (vLLM's `peagle` speculators type): EAGLE-3's layout, `mask_hidden` (the mask slots' feature
    before fc, n_aux * H) and `mask_token_id`; `parallel_tokens` is K, the drafts one forward makes."""
    _, tensors = eagle_layout(net, verifier)
    own = PEagleConfig(**eagle3_keys(net, verifier), mask_token_id=net.mask_token_id, parallel_tokens=net.parallel)
    return draft_layer_config(verifier, "llama", 1) | own.to_config(), tensors


def peagle_from_layout(config: dict[str, Any], tensors: dict[str, Tensor], verifier: Any, file: Path,
                       reference: bool) -> tuple[Any, None]:
    """The P-EAGLE network an export holds (its mask token and K from config.json, checked against the verifier)."""
    from models.peagle import PEagleNet, check_mask_token, check_parallel

    lc = layer_config(verifier)
    if "mask_hidden" not in tensors:
        raise UserError(f"{file}: no mask_hidden tensor, so this is not a P-EAGLE export (an EAGLE-3 one, maybe: load "
                        f"it as drafter=eagle3).")
    where = file.parent / "config.json"
    own = PEagleConfig.from_config(config, where)
    mask = check_mask_token(own.mask_token_id, lc["vocab_size"], f"{where}: mask_token_id")
    parallel = check_parallel(own.parallel_tokens, f"{where}: parallel_tokens")
    check_draft_layer(config, verifier, where, required=not reference)
    aux = aux_layer_ids(config, lc["num_verifier_layers"], where, required=not reference)
    draft = min(own.draft_vocab_size or lc["vocab_size"], lc["vocab_size"])
    check_draft_vocab(tensors, draft, lc["vocab_size"], file)
    hidden = tensors["mask_hidden"].reshape(-1)
    if hidden.numel() != len(aux) * lc["hidden_size"]:
        raise UserError(f"{file}: mask_hidden has {hidden.numel()} values; {len(aux)} feature layers x hidden size "
                        f"{lc['hidden_size']} = {len(aux) * lc['hidden_size']} expected. Re-export the drafter.")
    tensors["mask_hidden"] = hidden
    net = PEagleNet(mask_token_id=mask, parallel=parallel, draft_vocab_size=draft, aux_layer_ids=aux,
                    fc_norm=own.fc_norm, **lc)
    load_state(net, tensors, file)
    return net, None


def peagle_from_speculators(config: dict[str, Any], file: str, name: str, architecture: str) -> dict[str, Any]:
    """vLLM's `peagle` speculators config as the flat P-EAGLE config: EAGLE-3's, with EAGLE-3.1's options read from
    the layer config (where vLLM's peagle reads them, and only there)."""
    return eagle_from_speculators(config, file, name, architecture, options_in_layer=True, own=PEagleConfig)

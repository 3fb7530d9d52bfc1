"""DSpark's export layout: DFlash's (models/formats/dflash.py) plus its two heads' keys and tensors,
and its speculators format (vLLM's `qwen3_dspark`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from models.dspark import DSparkNet, check_markov
from models.eagle import layer_config
from models.formats.dflash import (
    DFlashConfig,
    dflash_from_layout,
    dflash_from_speculators,
    dflash_layout,
    dflash_to_speculators,
)
from runtime.errors import UserError

# -- the export layout -------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DSparkConfig(DFlashConfig):
    """A DSpark export's own config.json keys: DFlash's and the ones it adds (speculators 0.9's
    DSparkSpeculatorConfig, as vLLM reads them)."""

    markov_rank: int = field(metadata={"help": "the rank r of the Markov bias W2 W1[x]", "min": 1})
    markov_head_type: str = field(default="vanilla", metadata={
        "help": "the Markov head: vanilla (W2 W1[x]), gated or rnn (vLLM 0.32 serves vanilla)"})
    enable_confidence_head: bool = field(default=True, metadata={
        "help": "whether the export holds the per-slot acceptance head (vLLM's adaptive verification reads it)"})
    confidence_head_with_markov: bool = field(default=True, metadata={
        "help": "whether the confidence head reads [h_k, W1[x_{k-1}]] (true) or h_k alone"})


CONFIDENCE_TENSORS = ("confidence_head.proj.weight", "confidence_head.proj.bias")


def dspark_layout(net: DSparkNet, verifier: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """DFlash's layout (dflash_layout) with DSpark's keys; the tensors include the two heads'."""
    return dflash_layout(net, verifier, DSparkConfig, markov_rank=net.markov_rank,
                         markov_head_type=net.markov_head_type)


def dspark_from_layout(config: dict[str, Any], tensors: dict[str, Tensor], verifier: Any, file: Any,
                       reference: bool) -> tuple[DSparkNet, None]:
    """The DSpark network an export holds: DFlash's checks (dflash_from_layout), the Markov rank and head type, and
    the confidence head, without which the decoder cannot choose how much of a block to verify."""
    where = file.parent / "config.json"
    own = DSparkConfig.from_config(config, where)
    missing = [k for k in CONFIDENCE_TENSORS if k not in tensors]
    if not own.enable_confidence_head or missing:
        raise UserError(f"{file}: a DSpark export without its confidence head (enable_confidence_head="
                        f"{own.enable_confidence_head}, missing {missing or list(CONFIDENCE_TENSORS)}): this toolkit "
                        f"cuts each round's block where the head's predicted acceptance falls, and vLLM's adaptive "
                        f"verification reads it. Retrain with python train.py model=dspark (the head is always "
                        f"trained), or serve the backbone as DFlash.")
    if not own.confidence_head_with_markov:
        raise UserError(f"{where}: confidence_head_with_markov=false; this toolkit's confidence head reads "
                        f"[h_k, W1[x_k-1]] (speculators' default). Retrain with python train.py model=dspark.")
    lc = layer_config(verifier)
    rank, head_type = check_markov(own.markov_rank, own.markov_head_type, lc["vocab_size"], str(where))
    w1 = tensors.get("markov_head.markov_w1.weight")
    if w1 is None or tuple(w1.shape) != (lc["vocab_size"], rank):
        raise UserError(f"{file}: markov_head.markov_w1.weight is {None if w1 is None else tuple(w1.shape)}; "
                        f"markov_rank={rank} on this verifier needs {(lc['vocab_size'], rank)}. Pass the verifier the "
                        f"drafter was trained on.")
    base = {k: v for k, v in tensors.items() if not k.startswith(("markov_head.", "confidence_head."))}
    dflash, _ = dflash_from_layout(config, base, verifier, file, reference)
    net = DSparkNet(mask_token_id=dflash.mask_token_id, block_size=dflash.block_size, num_layers=len(dflash.layers),
                    aux_layer_ids=dflash.aux_layer_ids, markov_rank=rank, markov_head_type=head_type, **lc)
    from runtime.io import load_state

    load_state(net, tensors, file)
    return net, None


def dspark_to_speculators(flat: dict[str, Any], algorithm: str, verifier: str, architectures: list[str],
                          speculative_tokens: int) -> dict[str, Any]:
    """vLLM's `dspark` speculators type: DFlash's (dflash_to_speculators) with DSpark's architecture and keys;
    `sample_from_anchor: false`: the anchor is the bonus token and the block's K masks draft, as vLLM's default."""
    out = dflash_to_speculators(flat, algorithm, verifier, architectures, speculative_tokens)
    out["architectures"] = ["DSparkSpeculator"]
    return out


def dspark_from_speculators(config: dict[str, Any], file: str, name: str, architecture: str) -> dict[str, Any]:
    """vLLM's `dspark` speculators config back as the flat layout dspark_from_layout reads."""
    if config.get("enable_confidence_head") is False:
        raise UserError(f"{file}: enable_confidence_head=false: a DSpark export without its confidence head; this "
                        f"toolkit drafts with the head's predicted acceptance. Retrain with python train.py "
                        f"model=dspark.")
    if "markov_rank" not in config:
        raise UserError(f"{file}: speculators_model_type='dspark' needs markov_rank, which is missing: not a DSpark "
                        f"export (a DFlash one, relabelled?). Re-export it, or load it as dflash.")
    return dflash_from_speculators(config, file, name, architecture)


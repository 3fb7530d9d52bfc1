"""DFlash2's export layout: DFlash's (models/formats/dflash.py) plus its convolution and selector keys and tensors,
and its speculators format: the `dflash2` type, which vLLM serves through its `dflash` method (architecture
DFlash2DraftModel, `qwen3_dflash2`; the keys conv_kernel_size, conv_group_size, selector_rank, selector_top_k at the
top level, where vLLM's `update_dflash2` copies them into dflash_config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from models.dflash2 import DFlash2Net, check_dflash2
from models.eagle import layer_config
from models.formats.dflash import (
    DFlashConfig,
    dflash_from_layout,
    dflash_from_speculators,
    dflash_layout,
    dflash_to_speculators,
)
from runtime.errors import UserError

ARCHITECTURE = "DFlash2DraftModel"  # speculators' and vLLM's name (vLLM: qwen3_dflash2.DFlash2Qwen3ForCausalLM)
OWN_TENSORS = ("attention_conv.", "mlp_conv.", "candidate_selector.")


@dataclass(frozen=True, kw_only=True)
class DFlash2Config(DFlashConfig):
    """A DFlash2 export's own config.json keys: DFlash's and the ones it adds (speculators 0.9's
    DFlash2SpeculatorConfig, as vLLM reads them)."""

    conv_kernel_size: int = field(metadata={"help": "the dynamic convolution's causal taps along a block", "min": 1})
    conv_group_size: int = field(metadata={"help": "hidden channels sharing one dynamic kernel", "min": 1})
    selector_rank: int = field(metadata={"help": "the rank r of the selector's codebooks", "min": 1})
    selector_top_k: int = field(metadata={"help": "the unary candidates the selector re-scores per slot", "min": 2})


def dflash2_layout(net: DFlash2Net, verifier: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """DFlash's layout (dflash_layout) with DFlash2's keys; the tensors include the convolutions' and the selector's."""
    return dflash_layout(net, verifier, DFlash2Config, conv_kernel_size=net.conv_kernel_size,
                         conv_group_size=net.conv_group_size, selector_rank=net.selector_rank,
                         selector_top_k=net.selector_top_k)


def dflash2_from_layout(config: dict[str, Any], tensors: dict[str, Tensor], verifier: Any, file: Any,
                        reference: bool) -> tuple[DFlash2Net, None]:
    """The DFlash2 network an export holds: DFlash's checks (dflash_from_layout), then DFlash2's settings against the
    verifier and the selector's codebooks against the vocabulary."""
    from runtime.io import load_state

    where = file.parent / "config.json"
    own = DFlash2Config.from_config(config, where)
    base = {k: v for k, v in tensors.items() if not any(part in k for part in OWN_TENSORS)}
    dflash, _ = dflash_from_layout(config, base, verifier, file, reference)
    lc = layer_config(verifier)
    settings = check_dflash2(own.conv_kernel_size, own.conv_group_size, own.selector_rank, own.selector_top_k,
                             lc["hidden_size"], lc["vocab_size"], dflash.block_size, str(where))
    book = tensors.get("candidate_selector.predecessor_codebook")
    if book is None or tuple(book.shape) != (lc["vocab_size"], settings[2]):
        raise UserError(f"{file}: candidate_selector.predecessor_codebook is "
                        f"{None if book is None else tuple(book.shape)}; selector_rank={settings[2]} on this verifier "
                        f"needs {(lc['vocab_size'], settings[2])}. Pass the verifier the drafter was trained on.")
    net = DFlash2Net(mask_token_id=dflash.mask_token_id, block_size=dflash.block_size, num_layers=len(dflash.layers),
                     aux_layer_ids=dflash.aux_layer_ids, conv_kernel_size=settings[0], conv_group_size=settings[1],
                     selector_rank=settings[2], selector_top_k=settings[3], **lc)
    load_state(net, tensors, file)
    return net, None


def dflash2_to_speculators(flat: dict[str, Any], algorithm: str, verifier: str, architectures: list[str],
                           speculative_tokens: int) -> dict[str, Any]:
    """speculators' `dflash2` type: DFlash's (dflash_to_speculators: bidirectional blocks, the anchor as the bonus
    token) with DFlash2's architecture; its four keys stay at the top level, where vLLM reads them."""
    out = dflash_to_speculators(flat, algorithm, verifier, architectures, speculative_tokens)
    out["architectures"] = [ARCHITECTURE]
    return out


def dflash2_from_speculators(config: dict[str, Any], file: str, name: str, architecture: str) -> dict[str, Any]:
    """speculators' `dflash2` config back as the flat layout dflash2_from_layout reads."""
    missing = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if k not in config]
    if missing:
        raise UserError(f"{file}: speculators_model_type='dflash2' needs {', '.join(missing)}, which "
                        f"{'is' if len(missing) == 1 else 'are'} missing: not a DFlash2 export (a DFlash one, "
                        f"relabelled?). Re-export it, or load it as dflash.")
    return dflash_from_speculators(config, file, name, architecture)

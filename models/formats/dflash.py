"""DFlash's export layout and its speculators format (vLLM's `dflash`); models/families.py registers
it, models/exports/io.py does the files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from models.dflash import DFlashNet, check_block_size
from models.eagle import layer_config
from models.formats import parts
from models.formats.config import ExportConfig
from models.peagle import check_mask_token
from runtime.errors import UserError

# -- the export layout (models/families.py registers it; models/exports/io.py does the files) ----------------------

@dataclass(frozen=True, kw_only=True)
class DFlashTargets(ExportConfig):
    """DFlash's `dflash_config` object (the reference layout's)."""

    mask_token_id: int = field(metadata={"help": "the token each draft slot of a block is embedded as", "min": 0})
    target_layer_ids: list[int] = field(metadata={
        "help": "the verifier layers whose outputs feed the drafter (id k = output of layer k, this toolkit's k + 1)",
        "min": -1})


@dataclass(frozen=True, kw_only=True)
class DFlashConfig(ExportConfig):
    """A DFlash export's own config.json keys (the draft layers' shape beside them is the verifier's:
    models.formats.eagle.draft_layer_config, checked by check_draft_layer)."""

    num_hidden_layers: int = field(metadata={"help": "the drafter's Qwen3-style layers", "min": 1})
    layer_types: list[str] | None = field(default=None, metadata={"help": "each draft layer's attention (full)"})
    rope_scaling: dict | None = field(default=None, metadata={"help": "the draft layers' rotary scaling (none)"})
    attention_bias: bool = field(default=False, metadata={"help": "whether the draft layers' attention has biases "
                                                                  "(DFlash's has none)"})
    block_size: int = field(metadata={"help": "a block: the root token and block_size - 1 drafts", "min": 2})
    num_target_layers: int | None = field(default=None, metadata={"help": "the verifier's layer count", "min": 1})
    dflash_config: DFlashTargets = field(metadata={"help": "the mask token and the verifier layers the drafter reads"})
    aux_hidden_state_layer_ids: list[int] | None = field(default=None, metadata={
        "help": "the verifier layers the drafter reads, in this toolkit's convention (id k = input of layer k)",
        "min": 0})


def dflash_layout(net: DFlashNet, verifier: Any, config: type[DFlashConfig] = DFlashConfig, **own: Any
                  ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The DFlash reference layout (z-lab's, which vLLM's qwen3_dflash loads): a Qwen3-style config for the draft
    layers with DFlashConfig's keys: `block_size` and `dflash_config` (`mask_token_id`; `target_layer_ids` in that
    layout's convention, the output of layer k, i.e. this project's id minus 1), and the tensors without the shared
    embedding and head. A family built on DFlash passes its config class (a DFlashConfig with its fields added) and
    the values of its own fields (`own`)."""
    from models.formats.eagle import draft_layer_config

    lc = layer_config(verifier)
    keys = config(num_hidden_layers=len(net.layers), layer_types=["full_attention"] * len(net.layers),
                  block_size=net.block_size, num_target_layers=lc["num_verifier_layers"],
                  dflash_config=DFlashTargets(mask_token_id=net.mask_token_id,
                                              target_layer_ids=[k - 1 for k in net.aux_layer_ids]),
                  aux_hidden_state_layer_ids=list(net.aux_layer_ids), **own)
    tensors = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    return draft_layer_config(verifier, "qwen3", len(net.layers)) | keys.to_config(), tensors



def dflash_weights_agree(config: dict[str, Any], shapes: parts.Shapes) -> list[parts.Disagreement]:
    """A DFlash (or DSpark) export's draft layers and feature layers (dflash_config.target_layer_ids, written as
    aux_hidden_state_layer_ids) against its tensors (models.formats.parts.layer_stack_disagreements)."""
    section = config.get("dflash_config")
    ids = section.get("target_layer_ids") if isinstance(section, dict) else None
    ok = isinstance(ids, list) and ids and all(isinstance(k, int) for k in ids)
    features = ("aux_hidden_state_layer_ids", [k + 1 for k in ids], len(ids)) if ok else None
    return parts.layer_stack_disagreements(config, shapes, features)

def dflash_from_layout(config: dict[str, Any], tensors: dict[str, Tensor], verifier: Any, file: Any,
                       reference: bool) -> tuple[DFlashNet, None]:
    """The DFlash network an export holds, checked against the verifier's shapes and the settings an engine reads:
    the draft layers' (models.formats.eagle.check_draft_layer) and a block_size the window holds."""
    from models.formats.eagle import check_draft_layer
    from runtime.io import load_state

    where = file.parent / "config.json"
    cfg = DFlashConfig.from_config(config, where)
    aux = [k + 1 for k in cfg.dflash_config.target_layer_ids]
    lc = layer_config(verifier)
    check_draft_layer(config, verifier, where, required=not reference)
    # The window a block must fit: the verifier's, and the one the export tells an engine (max_position_embeddings).
    windows = [w for w in (getattr(verifier.config, "max_position_embeddings", None),
                           config.get("max_position_embeddings")) if isinstance(w, int) and not isinstance(w, bool)]
    block_size = check_block_size(cfg.block_size, min(windows) if windows else None, f"{where}: block_size")
    fc = tensors.get("fc.weight")
    if fc is None or tuple(fc.shape) != (lc["hidden_size"], len(aux) * lc["hidden_size"]):
        raise UserError(f"{file}: fc.weight is {None if fc is None else tuple(fc.shape)}; this verifier and "
                        f"{len(aux)} target layers need {(lc['hidden_size'], len(aux) * lc['hidden_size'])}. Pass the "
                        f"verifier the drafter was trained on.")
    net = DFlashNet(mask_token_id=check_mask_token(cfg.dflash_config.mask_token_id, lc["vocab_size"],
                                                   f"{where}: mask_token_id"),
                    block_size=block_size, num_layers=cfg.num_hidden_layers, aux_layer_ids=aux, **lc)
    load_state(net, tensors, file)
    return net, None


# -- the speculators format (models/exports/speculators.py): vLLM's dflash ---------------------------------------------

# DFlash's reference layout keeps these in its layer config; the speculators format moves the rest to the top level
# and into `dflash`'s own keys.
DFLASH_LAYER_KEYS = (*parts.LAYER_KEYS, "layer_types", "rope_scaling")


@dataclass(frozen=True, kw_only=True)
class DFlashSpeculators(ExportConfig):
    """The keys vLLM's `dflash` speculators type adds at the top level (DFlashConfig's, in vLLM's convention)."""

    block_size: int = field(metadata={"help": "a block: the root token and block_size - 1 drafts"})
    aux_hidden_state_layer_ids: list[int] = field(metadata={
        "help": "the verifier layers the drafter reads (id k = input of layer k)", "min": 0})
    mask_token_id: int = field(metadata={"help": "the token each draft slot of a block is embedded as", "min": 0})


def dflash_to_speculators(flat: dict[str, Any], algorithm: str, verifier: str, architectures: list[str],
                          speculative_tokens: int) -> dict[str, Any]:
    """DFlash's reference-layout config as vLLM's `dflash` speculators type: the layer config (Qwen3, every key written:
    vLLM fills in no defaults), `aux_hidden_state_layer_ids` in vLLM's convention (the input of layer k, which vLLM
    captures as given; it derives the reference layout's ids by subtracting 1), `mask_token_id`, bidirectional
    attention within the block (`sliding_window_non_causal`), and the block's drafts as the speculative tokens (the
    block fixes them: `speculative_tokens` is not read)."""
    layer = {k: flat[k] for k in DFLASH_LAYER_KEYS if k in flat} | {"architectures": ["Qwen3ForCausalLM"]}
    dconf = flat["dflash_config"]
    own = {k: v for k, v in flat.items()
           if k not in (*DFLASH_LAYER_KEYS, "architectures", "dflash_config", "aux_hidden_state_layer_ids",
                        "block_size")}
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": algorithm,
        "transformer_layer_config": layer,
        "draft_vocab_size": flat["vocab_size"],
        "target_hidden_size": None,
        "block_size": flat["block_size"],
        "aux_hidden_state_layer_ids": [int(k) + 1 for k in dconf["target_layer_ids"]],
        "mask_token_id": dconf["mask_token_id"],
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "torch_dtype": flat.get("torch_dtype"),
        "speculators_config": parts.speculators_config(algorithm, int(flat["block_size"]) - 1, verifier, architectures),
        **own,
    }


def dflash_from_speculators(config: dict[str, Any], file: str, name: str, architecture: str) -> dict[str, Any]:
    """vLLM's `dflash` speculators config back as DFlash's reference-layout config (`dflash_from_layout` reads it),
    written as `architecture`."""
    layer, section = config.get("transformer_layer_config"), config.get("speculators_config")
    if not isinstance(layer, dict) or not isinstance(section, dict):
        parts.check_sections(config, file)  # refuses the missing part
    parts.check_layer_keys(layer, file)
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
        if key not in config:
            raise UserError(f"{file}: speculators_model_type={config.get('speculators_model_type')!r} needs {key}, "
                            f"which is missing: not a DFlash export (another family's, relabelled?). Re-export the "
                            f"drafter, or load it as its own family.")
    own = DFlashSpeculators.from_config(config, file)
    if config.get("sliding_window_non_causal") is not True or config.get("sample_from_anchor"):
        raise UserError(f"{file}: sliding_window_non_causal must be true and sample_from_anchor false: this toolkit's "
                        f"DFlash attends both ways within the block and drafts from its mask slots, and vLLM would "
                        f"run another drafter otherwise. Re-export the drafter.")
    tokens = parts.speculative_tokens(config)
    if tokens != own.block_size - 1:
        raise UserError(f"{file}: speculative_tokens={tokens!r} but block_size={own.block_size}: vLLM drafts "
                        f"speculative_tokens from one block of block_size - 1 masks. Set it to {own.block_size - 1}.")
    flat = {k: v for k, v in config.items()
            if k not in (*parts.FORMAT_KEYS, "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal",
                         "sample_from_anchor", "draft_vocab_size", "target_hidden_size")}
    flat |= {k: v for k, v in layer.items() if k != "architectures"}
    flat["architectures"] = [architecture]
    flat["dflash_config"] = DFlashTargets(mask_token_id=own.mask_token_id,
                                          target_layer_ids=[k - 1 for k in own.aux_hidden_state_layer_ids]).to_config()
    flat["speculative_tokens"] = tokens
    flat["speculators_verifier"] = dict(section.get("verifier") or {})
    return flat

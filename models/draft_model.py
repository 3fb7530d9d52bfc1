"""A draft model M_p cut from the verifier M_q: its first k decoder layers, then its final norm and lm_head, run by
Hugging Face's own forward and cache, so it is a plain causal LM that `save_pretrained` writes and
`AutoModelForCausalLM` loads.

`truncate(model, k)` shares every weight with the verifier (eval's untrained self-speculative draft, no extra
memory); `truncate(model, k, own=True)` gives the draft its own trainable copies of the k layers and of the final
norm (what train/draft_model.py distils), still sharing the embeddings, the rotary table and the lm_head.

Export (`save_draft_model`): a standalone HF checkpoint directory (config.json with num_hidden_layers=k,
model.safetensors, the verifier's tokenizer) plus `specdraft_draft_model.json` holding the verifier fingerprint and
its loader description, written atomically. `python -m eval drafter=draft_model drafter.path=<dir>` reads it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.errors import UserError
from runtime.io import atomic_dir

INFO = "specdraft_draft_model.json"


def truncate(model: nn.Module, layers: int, own: bool = False, key: str = "drafter.layers") -> nn.Module:
    """The first `layers` decoder layers of `model` (a Llama-like HF causal LM) with its embeddings, final norm and
    lm_head. own=False: every module is the verifier's own; own=True: the layers and the final norm are float32
    copies (trainable), the embeddings, rotary table and lm_head stay shared. `key` names the setting in errors."""
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise UserError(f"{key}={layers}: a truncated copy needs a decoder with `model.layers` (Llama-like); "
                        f"{type(model).__name__} has none. Use drafter.path=<a small model with the verifier's "
                        f"tokenizer> instead.")
    total = len(blocks)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise UserError(f"{key}={layers!r}: the verifier has {total} layers; a truncated copy keeps between "
                        f"1 and {total - 1} of them.")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    with torch.device("meta"):
        draft = type(model)(config)
    kept, norm = blocks[:layers], model.model.norm
    if own:  # float32 copies: AdamW on bf16 weights would round most updates away
        kept, norm = copy.deepcopy(kept).float().requires_grad_(True), copy.deepcopy(norm).float().requires_grad_(True)
    draft.model.layers = nn.ModuleList(kept)  # layer_idx 0..k-1, as the cache expects
    draft.model.norm = norm
    for name in ("embed_tokens", "rotary_emb"):
        setattr(draft.model, name, getattr(model.model, name))
    draft.lm_head = model.lm_head
    left = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if left:
        raise UserError(f"A truncated copy of {type(model).__name__} left {left[:3]} unset; use "
                        f"drafter.path=<a small model with the verifier's tokenizer> instead.")
    return draft.eval()


def save_draft_model(draft: nn.Module, verifier: Any, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `draft` as a standalone float32 HF checkpoint with the verifier's tokenizer, and INFO (fingerprint,
    verifier description, `extra`), atomically; returns the directory."""
    standalone = copy.deepcopy(draft).float().cpu()  # the shared embeddings and head become its own (tied as before)
    info = {"verifier_fingerprint": verifier.fingerprint, "verifier": verifier.source, "verifier_name": verifier.name,
            "num_hidden_layers": int(standalone.config.num_hidden_layers), **(extra or {})}
    with atomic_dir(path) as tmp:
        standalone.save_pretrained(tmp)
        verifier.tokenizer.save_pretrained(tmp)
        (tmp / INFO).write_text(json.dumps(info, indent=1))
    return Path(path).expanduser()


def read_draft_info(path: str | Path) -> dict[str, Any] | None:
    """INFO of a draft model this project trained, or None for any other model (no such file)."""
    file = Path(str(path)).expanduser() / INFO
    if not file.is_file():
        return None
    try:
        info = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(info, dict) or not isinstance(info.get("verifier_fingerprint"), dict):
            raise ValueError("no verifier_fingerprint object")
    except ValueError as e:
        raise UserError(f"{file} cannot be read ({e}): the export is damaged. Train it again (python train.py "
                        f"model=draft_model), or delete that file to use the directory as a plain model.") from None
    return info

"""Medusa heads (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads").

K heads read the verifier's last hidden state h_t (the input of its lm_head). Head k (1-based) predicts token
t+k+1; the verifier's own head predicts t+1. Each head is `num_layers` residual blocks `x + SiLU(Linear(x))`,
zero-initialised so that a fresh head starts as the verifier's own head, then a vocabulary projection.

Module and tensor names follow vLLM's Medusa layout (`blocks.{h}.layers.{l}.weight|bias`, `lm_heads.{h}.weight` or
one shared `lm_head.weight` with `original_lm_head: true`), so `state_dict()` is the export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.errors import UserError
from models.io import atomic_dir
from models.verifier import Verifier, check_fingerprint

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class ResidualBlock(nn.Module):
    """`num_layers` times x <- x + SiLU(W x + b); each layer its own Linear (the reference's `[ResBlock] * L`
    shares a single block by mistake)."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers))
        self.act = nn.SiLU()
        for layer in self.layers:  # x + SiLU(0) = x: a fresh head begins exactly as the verifier's own head
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads. With `share_lm_head`, the vocabulary projection is the verifier's own (frozen, passed in at
    call time, never stored here); otherwise each head owns a projection initialised from the verifier's."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        share_lm_head: bool = True,
        lm_head_init: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.share_lm_head = num_heads, num_layers, share_lm_head
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers) for _ in range(num_heads))
        self.lm_heads: nn.ModuleList | None = None
        if not share_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
            if lm_head_init is not None:
                for head in self.lm_heads:
                    head.weight.data.copy_(lm_head_init)

    def head_features(self, hidden: Tensor, k: int) -> Tensor:
        """Features of head k (0-based) before its vocabulary projection. (..., D) -> (..., D)"""
        return self.blocks[k](hidden)

    def head_logits(self, hidden: Tensor, k: int, lm_head: nn.Module | None = None) -> Tensor:
        """Logits of head k (0-based), predicting token t+k+2 from h_t. (..., D) -> (..., V)"""
        proj = lm_head if self.share_lm_head else self.lm_heads[k]
        if proj is None:
            raise ValueError("MedusaHeads(share_lm_head=True) needs the verifier's lm_head passed in.")
        feats = self.head_features(hidden, k)
        return proj(feats.to(proj.weight.dtype))  # a shared frozen head may be bf16 while the blocks train in fp32

    def forward(self, hidden: Tensor, lm_head: nn.Module | None = None) -> Tensor:
        """All heads at once. (B, T, D) -> (K, B, T, V)"""
        return torch.stack([self.head_logits(hidden, k, lm_head) for k in range(self.num_heads)])


def medusa_targets(input_ids: Tensor, loss_mask: Tensor, num_heads: int) -> list[tuple[Tensor, Tensor]]:
    """Per-head (targets, valid) aligned with hidden positions t = 0..T-1.

    Head k (0-based) at position t predicts token t+k+2. Positions whose target falls off the end, or whose target
    is not an assistant token (`loss_mask` 0), are invalid. Returns K pairs of (B, T) tensors.
    """
    bsz, seqlen = input_ids.shape
    out = []
    for k in range(num_heads):
        shift = k + 2
        targets = torch.zeros_like(input_ids)
        valid = torch.zeros_like(loss_mask, dtype=torch.bool)
        if seqlen > shift:
            targets[:, : seqlen - shift] = input_ids[:, shift:]
            valid[:, : seqlen - shift] = loss_mask[:, shift:].bool()
        out.append((targets, valid))
    return out


def save_medusa_export(
    heads: MedusaHeads, verifier: Verifier, path: str | Path, extra: dict[str, Any] | None = None
) -> Path:
    """Write `config.json` + `model.safetensors` in vLLM's Medusa layout, atomically. Returns the directory."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    if heads.share_lm_head:
        # vLLM reads one `lm_head.weight` and shares it across heads when `original_lm_head` is set.
        tensors["lm_head.weight"] = verifier.lm_head.weight.detach().cpu().contiguous()
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "truncated_vocab_size": heads.vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": heads.share_lm_head,
        "verifier_path": verifier.path,
        "verifier_fingerprint": verifier.fingerprint,
        **(extra or {}),
    }
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return Path(path)


def read_export_config(path: str | Path) -> dict[str, Any]:
    """Read and sanity-check an export's config.json, with a clear error for a missing or corrupt one."""
    path = Path(path).expanduser()
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise UserError(f"checkpoint={str(path)!r}: no {CONFIG_NAME} there. Pass the `export/` directory train.py printed.")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_file} is not valid JSON ({e}); re-export the checkpoint.") from e


def _read_weights(path: Path) -> dict[str, Tensor]:
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise UserError(f"checkpoint={str(path)!r}: {WEIGHTS_NAME} is missing. Re-export it (train.py writes it on fit end).")
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{weights} is corrupt or truncated ({e}); re-export the checkpoint.") from e


def load_medusa_export(path: str | Path, verifier: Verifier) -> tuple[MedusaHeads, Tensor | None, dict[str, Any]]:
    """Rebuild Medusa heads from an export, refusing one made for another verifier.

    Returns (heads, shared lm_head weight or None, config). The shared weight is the export's own copy.
    """
    path = Path(path).expanduser()
    config = read_export_config(path)
    if config.get("model_type") != "medusa":
        raise UserError(
            f"checkpoint={str(path)!r} has model_type={config.get('model_type')!r}, not 'medusa'. "
            f"Use the drafter type that matches the export."
        )
    check_fingerprint(config.get("verifier_fingerprint", {}), verifier, f"Medusa export {str(path)!r}")
    tensors = _read_weights(path)
    shared = bool(config.get("original_lm_head", False))
    heads = MedusaHeads(
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        num_heads=config["num_heads"],
        num_layers=config["num_hidden_layers"],
        share_lm_head=shared,
    )
    lm_head = tensors.pop("lm_head.weight", None) if shared else None
    try:
        heads.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise UserError(f"{path / WEIGHTS_NAME} does not match its config.json: {str(e).splitlines()[0]}") from e
    return heads.eval().requires_grad_(False), lm_head, config

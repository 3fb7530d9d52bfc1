"""EAGLE drafters (Li et al., 2024/2025): a one-layer transformer that drafts from the verifier's features.

EAGLE-1 (`kind="eagle"`): the feature f_t is M_q's last hidden state (the input of its lm_head). One step reads
    fc(cat(embed(x_{t+1}), f_t)) -> decoder layer (no input norm) -> predicted f_{t+1}; M_q's own lm_head turns it
    into draft logits. Trained with feature regression + cross-entropy to q.
EAGLE-3 (`kind="eagle3"`): the feature is fc(cat(low, mid, high)) over three M_q layers (the inputs of layers
    2, L//2, L-3 by default). One step reads cat(norm(embed(x_{t+1})), norm(hidden)) -> decoder layer -> its own
    norm and lm_head over a reduced draft vocabulary (`d2t`: draft id -> target id offset, `t2d`: bool mask).
    Later steps feed the layer's own output back as `hidden` (training-time test unrolls this).

Both reuse M_q's token embedding (and, for EAGLE-1, its lm_head) by reference: frozen and never stored here.
Tensor names follow the layouts vLLM and SGLang load (`fc.weight`, `layers.0.*` / `midlayer.*`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`).
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from models.eagle_layers import DraftDecoderLayer, RMSNorm
from models.errors import UserError
from models.io import atomic_dir
from models.medusa import CONFIG_NAME, WEIGHTS_NAME, _read_weights, read_export_config
from models.verifier import Verifier, check_fingerprint

KINDS = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}
NAMES = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3"}


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high feature layers: the inputs of layers 2, L//2 and L-3."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


def layer_config(verifier: Verifier) -> dict[str, Any]:
    """The drafter layer's shape, taken from the verifier's own config (same family, one layer)."""
    c = verifier.config
    heads = int(c.num_attention_heads)
    rope_params = getattr(c, "rope_parameters", None) or {}
    return {
        "hidden_size": int(c.hidden_size),
        "intermediate_size": int(c.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        "rope_theta": float(rope_params.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        "rms_norm_eps": float(getattr(c, "rms_norm_eps", 1e-6)),
        "attention_bias": bool(getattr(c, "attention_bias", False)),
        "vocab_size": int(verifier.vocab_size),
        "num_verifier_layers": int(c.num_hidden_layers),
    }


class EagleDrafterNet(nn.Module):
    """The trainable part of an EAGLE-1 or EAGLE-3 drafter."""

    def __init__(self, kind: str, hidden_size: int, intermediate_size: int, num_attention_heads: int,
                 num_key_value_heads: int, head_dim: int, rope_theta: float, rms_norm_eps: float, vocab_size: int,
                 num_verifier_layers: int, attention_bias: bool = False, draft_vocab_size: int | None = None,
                 aux_layer_ids: list[int] | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise UserError(f"EAGLE kind {kind!r} is not one of {sorted(KINDS)}.")
        self.kind, self.hidden_size, self.vocab_size = kind, hidden_size, vocab_size
        self.num_verifier_layers = num_verifier_layers
        layer_args = (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rope_theta,
                      rms_norm_eps)
        if kind == "eagle":
            self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
            self.layers = nn.ModuleList([DraftDecoderLayer(*layer_args, two_inputs=False, attention_bias=attention_bias)])
            self.aux_layer_ids: list[int] = []
            self.draft_vocab_size = vocab_size
        else:
            self.aux_layer_ids = list(aux_layer_ids or default_aux_layers(num_verifier_layers))
            check_aux_layers(self.aux_layer_ids, num_verifier_layers)
            self.draft_vocab_size = min(int(draft_vocab_size or vocab_size), vocab_size)
            self.fc = nn.Linear(len(self.aux_layer_ids) * hidden_size, hidden_size, bias=False)
            self.midlayer = DraftDecoderLayer(*layer_args, two_inputs=True, attention_bias=attention_bias)
            self.norm = RMSNorm(hidden_size, rms_norm_eps)
            self.lm_head = nn.Linear(hidden_size, self.draft_vocab_size, bias=False)
            # Identity mapping until set_draft_vocab is called with the training data's most frequent tokens.
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(vocab_size, dtype=torch.bool)
            t2d[: self.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)

    @property
    def layer(self) -> DraftDecoderLayer:
        return self.layers[0] if self.kind == "eagle" else self.midlayer

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """EAGLE-3: the draft vocabulary is `target_ids` (sorted ascending inside), stored as d2t offsets + t2d mask."""
        ids = torch.sort(target_ids.to(torch.long).flatten()).values
        if ids.numel() != self.draft_vocab_size or ids.max() >= self.vocab_size or ids.unique().numel() != ids.numel():
            raise UserError(f"the draft vocabulary must be {self.draft_vocab_size} distinct ids below the verifier's "
                            f"vocabulary size {self.vocab_size}; got {ids.numel()} ids.")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to verifier ids (identity for EAGLE-1)."""
        return draft_ids if self.kind == "eagle" else draft_ids + self.d2t[draft_ids]

    def features(self, hidden_states: Sequence[Tensor] | Mapping[int, Tensor]) -> Tensor:
        """The drafter's input features from M_q's hidden states, indexed like HF `output_hidden_states`
        (0 = embeddings, i = input of layer i, -1 = final-normed): the tuple itself, or a {layer id: tensor} dict.
        (B, T, D)"""
        if self.kind == "eagle":
            return hidden_states[-1]
        return self.fc(torch.cat([hidden_states[i] for i in self.aux_layer_ids], dim=-1).to(self.fc.weight.dtype))

    def step(self, hidden: Tensor, embeds: Tensor, positions: Tensor, mask: Tensor, past_k: Tensor | None = None,
             past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One drafter forward. hidden: features (step 0) or the previous step's output (B, T, D); embeds: M_q's
        embedding of the next tokens (B, T, D). Returns (output (B, T, D), this call's k, v)."""
        dtype = self.fc.weight.dtype
        hidden, embeds = hidden.to(dtype), embeds.to(dtype)
        if self.kind == "eagle":
            x = self.fc(torch.cat([embeds, hidden], dim=-1))  # (B, T, D)
            return self.layer(x, None, positions, mask, past_k, past_v)
        return self.layer(hidden, embeds, positions, mask, past_k, past_v)

    def logits(self, out: Tensor, verifier_lm_head: nn.Module | None = None) -> Tensor:
        """Draft logits over the draft vocabulary (EAGLE-3) or the full vocabulary through M_q's head (EAGLE-1)."""
        if self.kind == "eagle":
            return verifier_lm_head(out.to(verifier_lm_head.weight.dtype))
        return self.lm_head(self.norm(out))


def check_aux_layers(layer_ids: list[int], num_layers: int) -> None:
    bad = [i for i in layer_ids if not 0 <= i <= num_layers]
    if bad or len(layer_ids) == 0:
        raise UserError(f"EAGLE-3 feature layer ids {layer_ids} are out of range for a verifier with {num_layers} "
                        f"layers (valid: 0..{num_layers}, the inputs of layers; default {default_aux_layers(num_layers)}).")


def build_eagle(kind: str, verifier: Verifier, draft_vocab_size: int | None = None,
                aux_layer_ids: list[int] | None = None) -> EagleDrafterNet:
    return EagleDrafterNet(kind, **layer_config(verifier), draft_vocab_size=draft_vocab_size,
                           aux_layer_ids=aux_layer_ids)


def save_eagle_export(net: EagleDrafterNet, verifier: Verifier, path: str | Path,
                      extra: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors in the EAGLE layout vLLM / SGLang read, atomically."""
    from safetensors.torch import save_file

    lc = layer_config(verifier)
    config = {
        "architectures": [KINDS[net.kind]],
        "model_type": "llama",
        "hidden_size": lc["hidden_size"],
        "intermediate_size": lc["intermediate_size"],
        "num_attention_heads": lc["num_attention_heads"],
        "num_key_value_heads": lc["num_key_value_heads"],
        "head_dim": lc["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": lc["rms_norm_eps"],
        "rope_theta": lc["rope_theta"],
        "attention_bias": lc["attention_bias"],
        "hidden_act": "silu",
        "vocab_size": lc["vocab_size"],
        "max_position_embeddings": int(getattr(verifier.config, "max_position_embeddings", 2048)),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_kind": net.kind,
        "verifier_num_hidden_layers": lc["num_verifier_layers"],
        "verifier_path": verifier.path,
        "verifier_fingerprint": verifier.fingerprint,
        **(extra or {}),
    }
    if net.kind == "eagle3":
        config["draft_vocab_size"] = net.draft_vocab_size
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": net.aux_layer_ids, "use_aux_hidden_state": True}
    tensors = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return Path(path)


def export_kind(config: dict[str, Any]) -> str | None:
    arch = (config.get("architectures") or [""])[0]
    return {v: k for k, v in KINDS.items()}.get(arch) or config.get("eagle_kind")


def load_eagle_export(path: str | Path, verifier: Verifier, kind: str | None = None) -> tuple[EagleDrafterNet, dict]:
    """Rebuild an EAGLE drafter from an export, checking its kind, verifier, layer ids and draft vocabulary."""
    path = Path(path).expanduser()
    config = read_export_config(path)
    found = export_kind(config)
    if found is None:
        raise UserError(f"checkpoint={str(path)!r} is not an EAGLE export (architectures="
                        f"{config.get('architectures')}, model_type={config.get('model_type')!r}).")
    if kind is not None and found != kind:
        raise UserError(f"checkpoint={str(path)!r} is an {NAMES[found]} export ({KINDS[found]}) but was given as "
                        f"{NAMES[kind]}. Use drafter={found} for it, or pass an {NAMES[kind]} export.")
    check_fingerprint(config.get("verifier_fingerprint", {}), verifier, f"{NAMES[found]} export {str(path)!r}")
    lc = layer_config(verifier)
    aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if found == "eagle3":
        check_aux_layers(list(aux or []), lc["num_verifier_layers"])
    tensors = _read_weights(path)
    if found == "eagle3":
        t2d, d2t = tensors.get("t2d"), tensors.get("d2t")
        if t2d is None or d2t is None or t2d.numel() != lc["vocab_size"] or int((d2t + torch.arange(d2t.numel())).max()) >= lc["vocab_size"]:
            raise UserError(f"{path / WEIGHTS_NAME}: the draft vocabulary (d2t/t2d) does not fit the verifier's "
                            f"vocabulary of {lc['vocab_size']} tokens. Retrain the drafter for this verifier.")
    net = EagleDrafterNet(found, **lc, draft_vocab_size=config.get("draft_vocab_size"), aux_layer_ids=aux)
    try:
        net.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise UserError(f"{path / WEIGHTS_NAME} does not match its config.json: {str(e).splitlines()[0]}") from e
    return net.eval().requires_grad_(False), config

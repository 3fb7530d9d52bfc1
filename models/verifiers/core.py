"""The frozen verifier M_q as every layer holds it: the `Verifier` record, freezing, the weights'
fingerprint and its check, dtypes and renderings.

The verifier is frozen (eval mode, no grads) and is not an nn.Module attribute of anything that gets saved:
training code holds it by reference so Lightning checkpoints never contain it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    PreTrainedTokenizerBase,
)

from runtime.errors import UserError, VerifierMismatchError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_cache_dir() -> Path:
    """Where caches live: $SPECDRAFT_CACHE, else ~/.cache/specdraft."""
    return Path(os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser()


class Verifier:
    """A frozen causal LM with its tokenizer and identity.

    A plain class on purpose: Hydra would turn a dataclass passed to `instantiate(..., verifier=v)` into a config.

    source: how to load it again, `{"loader": <key of LOADERS>, **arguments}`; exports store it, so that
        `load_verifier(source)` rebuilds this verifier (the fingerprint then checks that it did).
    name: a display name for logs and reports.
    checkpoint: where a serving engine loads the same weights and tokenizer from (a local Hugging Face directory or
        a Hub id), or None for a verifier built in memory (`save_checkpoint` writes one).
    rendering: how conversations become the verifier's tokens (data/chat.py): `chat` through its chat template, or
        `plain` as plain text the model continues (a base model, which has no template).
    """

    def __init__(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, source: dict[str, Any], name: str,
        fingerprint: dict[str, Any], checkpoint: str | None = None, rendering: str = "chat",
    ) -> None:
        self.model, self.tokenizer, self.source = model, tokenizer, source
        self.name, self.fingerprint = name, fingerprint
        self.checkpoint = checkpoint
        self.rendering = check_rendering(rendering, tokenizer, name)

    def __repr__(self) -> str:
        return f"Verifier(name={self.name!r}, source={self.source}, fingerprint={self.fingerprint})"

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def token_embedding(self) -> nn.Module:
        """The verifier's token embedding as every drafter reads it (trained and drafting alike): its table's rows
        as they are. A model that scales its embedding inside the module (Gemma: x sqrt(hidden), 25.3 for Gemma 3
        270M) is read without that scale, as serving engines read it: vLLM's drafters share the target's embedding
        table, and its Gemma models apply the scale outside the table (`gemma3.py`: `embed_tokens(ids) *
        normalizer`), so a drafter trained on the scaled rows would be served inputs 25x smaller than it learned."""
        table = self.model.get_input_embeddings()
        return table if type(table).forward is nn.Embedding.forward else RawEmbedding(table)

    def to(self, device: torch.device | str) -> Verifier:
        self.model.to(device)
        return self

    @torch.no_grad()
    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Last-layer hidden states after the final norm, i.e. the input of lm_head. (B, T, D)"""
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter (name, shape, values cast to bfloat16), so different weights never share a key.

    Cast to bfloat16 so the same verifier loaded in fp32 or bf16 matches. About 0.3 s for SmolLM2-135M on CPU.
    """
    h = hashlib.sha256()
    for name, p in model.named_parameters():  # tied weights appear once
        h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(p.detach().to("cpu", torch.bfloat16).contiguous().reshape(-1).view(torch.int16).numpy())
    return h.hexdigest()[:16]


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """Identify a verifier: architecture, sizes, a hash of its lm_head weights and a hash of all its weights.

    Hashes are taken over the weights cast to bfloat16, so the same verifier loaded in fp32 or bf16 matches.
    `weights_sha256` was added later: exports written before it carry only `lm_head_sha256` and still load
    (see `check_fingerprint`).
    """
    cfg = model.config
    weight = model.get_output_embeddings().weight.detach().to("cpu", torch.bfloat16).contiguous()
    digest = hashlib.sha256(weight.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    return {
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "vocab_size": int(weight.shape[0]),
        "lm_head_sha256": digest,
        "weights_sha256": weights_digest(model),
    }


# Fingerprint keys added after exports were first written: an export without one is checked on the others.
LATER_KEYS = ("weights_sha256",)


def check_fingerprint(expected: dict[str, Any], verifier: Verifier, what: str) -> None:
    """Refuse `what` (a checkpoint, a cache) made for another verifier, naming both sides."""
    actual = verifier.fingerprint
    diff = {k: (expected.get(k), actual.get(k)) for k in actual
            if expected.get(k) != actual.get(k) and not (k in LATER_KEYS and k not in expected and expected)}
    if diff:
        details = ", ".join(f"{k}: {a!r} (checkpoint) vs {b!r} (verifier)" for k, (a, b) in diff.items())
        raise VerifierMismatchError(
            f"{what} was trained for a different verifier than {verifier.name!r}: {details}. "
            f"Pass the verifier it was trained on (verifier.path=...), or retrain the drafter for this verifier."
        )


def template_sha256(tokenizer: Any) -> str:
    """sha256 of the tokenizer's chat template text (what turns messages into the ids a shipped set or a served record
    holds)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        raise UserError(f"the verifier's tokenizer ({type(tokenizer).__name__}) has no chat template as text; a "
                        f"shipped set or a served record records the template it was rendered with.")
    return hashlib.sha256(template.encode()).hexdigest()


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"verifier.dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


def resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


RENDERINGS = ("chat", "plain")


class RawEmbedding(nn.Module):
    """An embedding module's table looked up as it is, without what the module's own forward adds (a scale)."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    @property
    def weight(self) -> Tensor:
        return self.table.weight

    def forward(self, ids: Tensor) -> Tensor:
        return nn.functional.embedding(ids, self.table.weight)


def check_rendering(rendering: str, tokenizer: PreTrainedTokenizerBase, name: str) -> str:
    """Refuse a rendering this verifier cannot do: an unknown one, or `chat` for a tokenizer without a chat template
    (a base model)."""
    if rendering not in RENDERINGS:
        raise UserError(f"verifier.rendering={rendering!r} is not one of {list(RENDERINGS)}: `chat` renders "
                        f"conversations through the verifier's chat template, `plain` as plain text it continues.")
    if rendering == "chat" and getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"verifier.rendering=chat, but {name!r} is a base model: its tokenizer has no chat template "
                        f"to render conversations with. Use verifier.rendering=plain (prompts as plain text the "
                        f"model continues), or an instruct/chat model.")
    return rendering


def finish_verifier(model: nn.Module, tokenizer: PreTrainedTokenizerBase, source: dict[str, Any], name: str,
            checkpoint: str | None = None, rendering: str = "chat") -> Verifier:
    check_rendering(rendering, tokenizer, name)  # before the fingerprint's hashing: bad input fails fast
    freeze(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Verifier(model=model, tokenizer=tokenizer, source=source, name=name, fingerprint=fingerprint(model),
                    checkpoint=checkpoint, rendering=rendering)

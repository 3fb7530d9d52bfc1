"""Any Hugging Face causal LM as the verifier, by Hub id or local directory (`load_hf`), never with code of
its own unless the user asks; `save_checkpoint` writes one built in memory.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
)

from models.verifiers.core import Verifier, finish_verifier, resolve_device, resolve_dtype
from runtime.errors import UserError
from runtime.io import atomic_dir


def save_checkpoint(verifier: Verifier, path: str | os.PathLike) -> Path:
    """Write the verifier as a Hugging Face checkpoint directory (weights, config, tokenizer, chat template), in
    float32, atomically, and make it the verifier's `checkpoint`: for a verifier built in memory (the tiny test
    verifiers) that a serving engine must load. Returns the directory."""
    with atomic_dir(path) as tmp:
        model = verifier.model
        if model.dtype != torch.float32:  # Module.to works in place: convert a copy
            model = copy.deepcopy(model).to(torch.float32)
        model.save_pretrained(tmp)
        verifier.tokenizer.save_pretrained(tmp)
    verifier.checkpoint = str(Path(path).resolve())
    return Path(path)


# Keys of a Hugging Face config file that make transformers import Python from the checkpoint (trust_remote_code).
CODE_KEYS = ("auto_map",)
HF_FILES = ("config.json", "tokenizer_config.json")


def from_file(source: dict[str, Any], field: str) -> dict[str, Any]:
    """A verifier description read from a file (an export's `verifier` entry), not given by the user: one of the `hf`
    loader is loaded from this machine only and never with code of its own (load_hf's `named_by`, naming `field`)."""
    return dict(source, named_by=field) if source.get("loader") == "hf" else dict(source)


def _code_files(target: str, local: bool) -> list[str]:
    """The config files of a checkpoint (a local directory, or a Hub id already in this machine's cache: nothing is
    downloaded) that ask transformers to import code of the checkpoint's own (`auto_map`)."""
    found = []
    for name in HF_FILES:
        if local:
            file: Any = Path(target) / name
        else:
            from huggingface_hub import try_to_load_from_cache

            file = try_to_load_from_cache(target, name)
        if not isinstance(file, (str, Path)) or not Path(file).is_file():
            continue
        try:
            config = json.loads(Path(file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # transformers refuses it below, with its own message
        if isinstance(config, dict) and any(config.get(k) for k in CODE_KEYS):
            found.append(name)
    return found


def load_hf(path: str, dtype: str = "float32", name: str | None = None, device: str = "auto",
            named_by: str | None = None, rendering: str | None = None) -> Verifier:
    """Load any Hugging Face causal LM (Hub id or local directory) as a frozen verifier, never running code the
    checkpoint brings (trust_remote_code=False). `named_by`: the file field that named it (an export's `verifier`),
    when the user did not: then it is loaded from this machine only (a local directory, or a Hub id already in the
    cache; nothing is downloaded), and a checkpoint that asks for code of its own (`auto_map`) is refused.
    `rendering`: chat or plain (see `Verifier`); None: chat where the tokenizer has a template, else plain."""
    if not path:
        raise UserError("verifier.path is empty: give a Hub id or a local checkpoint directory.")
    local = Path(path).expanduser()
    looks_local = path.startswith((".", "/", "~")) or local.exists()
    if looks_local and not (local / "config.json").is_file():
        raise UserError(
            f"verifier.path={path!r}: no config.json in that directory. Point it at a Hugging Face checkpoint "
            f"directory (config.json + weights + tokenizer), or use the default verifier=smollm2."
        )
    target = str(local) if looks_local else path
    yourself = (f"If you trust it, pass the verifier yourself: verifier_path={path} (python -m eval) or --verifier "
                f"{path} (python -m scripts.tools.convert)")
    if named_by is not None:
        code = _code_files(target, looks_local)
        if code:
            raise UserError(f"{named_by} names the verifier {path!r}, whose {' and '.join(code)} carry an auto_map: "
                            f"loading it would run Python code from that checkpoint, and a verifier named by a file "
                            f"is never loaded with code. {yourself}; it then loads without that code "
                            f"(trust_remote_code=False), or use the default verifier_path=smollm2.")
    try:
        config = AutoConfig.from_pretrained(target, trust_remote_code=False, local_files_only=named_by is not None)
        check_causal_lm(config, f"{named_by} names the verifier {path!r}, which" if named_by else
                        f"verifier.path={path!r}")
        tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=False,
                                                  local_files_only=named_by is not None)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=resolve_dtype(dtype), trust_remote_code=False,
                                                     local_files_only=named_by is not None)
    except (OSError, ValueError) as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if named_by is not None:
            raise UserError(f"{named_by} names the verifier {path!r}, which does not load from this machine alone "
                            f"({reason}); a verifier named by a file is never downloaded. {yourself}.") from e
        raise UserError(
            f"verifier.path={path!r} could not be loaded as a causal LM ({reason}). "
            f"Give a local checkpoint directory or a Hub id this machine can reach; the default is verifier=smollm2."
        ) from e
    if rendering is None:
        rendering = "chat" if getattr(tokenizer, "chat_template", None) is not None else "plain"
    source = {"loader": "hf", "path": path} | ({"rendering": rendering} if rendering != "chat" else {})
    return finish_verifier(model.to(resolve_device(device)), tokenizer, source, name or Path(path).name,
                   str(local.resolve()) if looks_local else path, rendering)


def check_causal_lm(config: Any, what: str) -> None:
    """A verifier is a decoder-only causal LM: q is its next-token distribution given the tokens before. An encoder
    (BERT: bidirectional attention) or an encoder-decoder (T5, BART) is refused from its config, before any weights
    load (transformers would load BERT as BertLMHeadModel, an encoder the drafters and the engine cannot read)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED

    kind = getattr(config, "model_type", None)
    if kind in CAUSAL and kind not in MASKED and not getattr(config, "is_encoder_decoder", False):
        return
    archs = list(getattr(config, "architectures", None) or [])
    raise UserError(f"{what} is not a causal language model (model_type={kind!r}, architectures={archs}). Give a "
                    f"decoder-only causal LM (an architecture named *ForCausalLM: Llama, Mistral, Qwen2, Qwen3, "
                    f"Phi-3, Gemma 3), or use the default verifier=smollm2.")

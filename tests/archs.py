"""Tiny random verifiers of each architecture the conformance matrix covers, built from transformers config classes
(no download): Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral with a sliding window, Gemma 3 with local and global layers,
Phi-3. Each has head_dim 64 (what vLLM's CPU attention takes), 3 layers (EAGLE-3 reads three distinct layers, as
vLLM's does; Gemma 3: 4, two local and two global), the
default verifier's tokenizer (as models.verifiers.tiny.build_tiny), and weights redrawn large enough (as `varied_llama`)
that its greedy output varies, so the cache, the masks and the windows are exercised.

`arch_verifier(name, dtype, directory)` saves the checkpoint to `directory/<name>` once and loads it back through
models.verifiers.hf.load_hf, so exports trained on it name a checkpoint a reader (and vLLM) can load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

HEAD_DIM = 64
HIDDEN = 128
WINDOW_MISTRAL = 24  # longer than the engine's near window (16): the window hides far keys
WINDOW_GEMMA = 8  # shorter than it: the window hides near keys too
LAYER_STD = 0.15


def _common(vocab: int, tokenizer: Any, layers: int = 3) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, max_position_embeddings=2048,
                tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _config(name: str, tokenizer: Any) -> Any:
    """The transformers config of architecture `name` (see ARCHS)."""
    import transformers as tf

    vocab = len(tokenizer)
    c = _common(vocab, tokenizer)
    if name == "llama":
        return tf.LlamaConfig(**c)
    if name == "qwen2":
        return tf.Qwen2Config(**c)  # q/k/v biases
    if name == "qwen3":
        return tf.Qwen3Config(**c)  # q/k norms
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**c, moe_intermediate_size=HIDDEN, num_experts=4, num_experts_per_tok=2,
                                 decoder_sparse_step=1)
    if name == "mistral":
        return tf.MistralConfig(**c, sliding_window=WINDOW_MISTRAL)
    if name == "gemma3":
        c = _common(vocab, tokenizer, layers=4)
        return tf.Gemma3TextConfig(**c, sliding_window=WINDOW_GEMMA, query_pre_attn_scalar=HEAD_DIM // 2,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   hidden_activation="gelu_pytorch_tanh")
    if name == "phi3":
        return tf.Phi3Config(**c)  # fused qkv_proj / gate_up_proj
    raise KeyError(f"no tiny verifier {name!r}; known: {', '.join(ARCHS)}")


ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "phi3")


def build_model(name: str, tokenizer: Any, seed: int = 0) -> torch.nn.Module:
    """The random fp32 model of architecture `name`, its decoder matrices redrawn from N(0, LAYER_STD^2) and its norm
    weights perturbed (so a norm's weight, Gemma's 1 + w included, matters)."""
    from transformers import AutoModelForCausalLM

    config = _config(name, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.model.layers.named_parameters():
            if p.ndim == 2 and "gate.weight" not in pname:  # MoE routers keep their init: routing by near-ties
                p.copy_(torch.randn(p.shape, generator=gen) * LAYER_STD)
            elif "norm" in pname:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.ndim == 1:  # biases (Qwen2's q/k/v)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def checkpoint(name: str, directory: str | os.PathLike) -> Path:
    """The checkpoint directory of tiny verifier `name` under `directory`, written once (config, weights,
    tokenizer)."""
    from models.verifiers.embedded import ensure_smollm2_checkpoint, local_tokenizer

    path = Path(directory) / f"tiny-{name}"
    if (path / "config.json").is_file():
        return path
    tokenizer = local_tokenizer(ensure_smollm2_checkpoint(os.environ.get("SPECDRAFT_CACHE")))
    model = build_model(name, tokenizer)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # xdist workers may build it at once: one rename wins
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another worker's copy (the same seeded weights) is already there
        shutil.rmtree(tmp)
    return path


def arch_verifier(name: str, directory: str | os.PathLike, dtype: str = "float32"):
    """Tiny verifier `name` loaded from its checkpoint under `directory` (models.verifiers.hf.load_hf), on the CPU."""
    from models.verifiers.hf import load_hf

    return load_hf(str(checkpoint(name, directory)), dtype=dtype, device="cpu")

"""`build_tiny`: a 2-layer random Llama with the default verifier's tokenizer, for tests.
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
)

from models.verifiers.core import Verifier, finish_verifier, resolve_device, resolve_dtype
from models.verifiers.embedded import ensure_smollm2_checkpoint, from_cache, local_tokenizer


def build_tiny(
    cache_dir: str | None = None,
    dtype: str = "float32",
    device: str = "auto",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    seed: int = 0,
    initializer_range: float = 0.02,
    layer_std: float | None = None,
    rendering: str = "chat",
) -> Verifier:
    """A random `num_layers`-layer Llama with the default verifier's tokenizer and chat template, for tests.

    layer_std: redraw the decoder layers' weight matrices from N(0, layer_std^2) (generator seeded 0): with 0.3 the
    model's greedy output varies instead of repeating one token, so it exercises caches and masks."""
    tokenizer = from_cache(ensure_smollm2_checkpoint(cache_dir), local_tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
        initializer_range=initializer_range,  # larger: peakier next-token distributions, for tests that need them
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if layer_std is not None:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.model.layers.parameters():
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * layer_std)
    source = {"loader": "tiny", "num_layers": num_layers, "hidden_size": hidden_size, "num_heads": num_heads,
              "seed": seed, "initializer_range": initializer_range, "layer_std": layer_std}
    if rendering != "chat":
        source["rendering"] = rendering
    name = f"tiny-llama-{num_layers}x{hidden_size}-seed{seed}"
    model = model.to(device=resolve_device(device), dtype=resolve_dtype(dtype))
    return finish_verifier(model, tokenizer, source, name, rendering=rendering)

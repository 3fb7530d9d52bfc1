"""The verifiers: the embedded default loads from its cache and answers; bad paths give clear errors."""

from __future__ import annotations

import pytest
import torch

from data.chat import prompt_ids
from models.verifiers.embedded import load_smollm2
from models.verifiers.hf import load_hf
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError


def test_default_verifier_answers_a_chat_prompt(smollm2):
    ids = prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, top_k=None, top_p=None)
    answer = smollm2.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "Paris" in answer
    assert smollm2.fingerprint["architecture"] == "LlamaForCausalLM"
    assert (smollm2.hidden_size, smollm2.vocab_size, smollm2.num_layers) == (576, 49152, 30)
    assert not any(p.requires_grad for p in smollm2.model.parameters()) and not smollm2.model.training


def test_default_verifier_loads_from_the_cache(smollm2, cache_dir):
    # With a GGUF path that does not exist, only the cached HF checkpoint can serve the load.
    again = load_smollm2(cache_dir=cache_dir, dtype="bfloat16", gguf_path="/nonexistent/model.gguf")
    assert again.fingerprint == smollm2.fingerprint  # the fingerprint does not depend on the dtype
    assert again.dtype == torch.bfloat16


def test_fingerprints_tell_verifiers_apart(tiny, smollm2, cache_dir):
    assert tiny.fingerprint != smollm2.fingerprint
    assert build_tiny(cache_dir=cache_dir, seed=0).fingerprint == tiny.fingerprint
    assert build_tiny(cache_dir=cache_dir, seed=1).fingerprint["lm_head_sha256"] != tiny.fingerprint["lm_head_sha256"]


def test_hf_loader_reads_a_local_checkpoint(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_hf(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.fingerprint == tiny.fingerprint


@pytest.mark.parametrize("path, message", [("/nonexistent/verifier", "no config.json"), ("", "empty")])
def test_bad_verifier_path(path, message):
    with pytest.raises(UserError, match=message):
        load_hf(path)


def test_bad_dtype(cache_dir):
    with pytest.raises(UserError, match="verifier.dtype"):
        build_tiny(cache_dir=cache_dir, dtype="float8")


def test_drafters_read_the_embedding_table_as_serving_engines_do(tmp_path):
    """Gemma scales its embedding inside the module (x sqrt(hidden)); vLLM's drafters share the target's table and
    read it without that scale (its Gemma models apply it outside the table). Verifier.token_embedding, what every
    EAGLE-family drafter reads in training and in drafting, is the table's rows as they are; for a model without a
    scale, the module itself."""
    from archs import arch_verifier

    from eval.drafters.eagle import EagleDrafter
    from models.eagle import build_eagle

    gemma = arch_verifier("gemma3", tmp_path)
    ids = torch.tensor([[5, 17, 99]])
    table = gemma.model.get_input_embeddings()
    raw = table.weight[ids]
    assert torch.equal(gemma.token_embedding(ids), raw) and gemma.token_embedding.weight is table.weight
    assert torch.allclose(table(ids), raw * gemma.config.hidden_size ** 0.5)  # what Hugging Face's module returns
    assert torch.equal(EagleDrafter(build_eagle("eagle", gemma), gemma).embed(ids), raw)
    llama = arch_verifier("llama", tmp_path)
    assert llama.token_embedding is llama.model.get_input_embeddings()

"""The verifiers: the embedded default loads from its cache and answers; bad paths give clear errors."""

from __future__ import annotations

import pytest
import torch

from data.chat import prompt_ids
from models.verifier import build_tiny, load_hf, load_smollm2
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

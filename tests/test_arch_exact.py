"""Exact decoding beyond Llama (issue 53, item 4): eval.engine.forward runs Qwen3 (q/k norms), Gemma 3 (sliding
windows, sandwich norms, 1 + w norms, embedding scale, local/global rotary), Phi-3 (fused weights) and Mistral with a
sliding window through one description read from the config (eval.engine.arch), and any other architecture falls
back to Hugging Face's forward with a message naming it.

The standard is test_engine.py's and test_exact_bf16.py's, per architecture on its tiny random verifier
(tests/archs.py): (1) fp32, the engine's logits and hidden states equal Hugging Face's (prefill and one-token steps,
past the window) and its greedy decode emits HF's plain greedy tokens; (2) bf16, speculative decoding through the
engine emits plain greedy's tokens exactly (greedy_match 1.0) with accepted paths through every branch of a tree.
Negative controls: each architecture's special piece removed from its description moves the logits off HF's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from archs import ARCHS, arch_verifier
from test_exact_bf16 import SPARSE, Oracle

from eval.engine import forward as engine
from eval.engine.arch import Unsupported, describe, fallback_note
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.session import use_engine
from eval.engine.tree import from_medusa_choices
from helpers import run_shared

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE_ARCHS = [a for a in ARCHS if a != "qwen3_moe"]
PROMPT_LEN, STEPS, MAX_NEW = 24, 24, 40  # 48 tokens: past Mistral's window (24) and Gemma's (8)
# What makes each architecture itself, and a description without it: the engine must then leave HF's logits.
BROKEN = {
    "qwen3": [("qk_norm", False)],
    "gemma3": [("embed_scale", None), ("windows", (None,) * 4), ("norm_offset", 0.0), ("sandwich", False),
               ("rope_kinds", ("full_attention",) * 4), ("act", "silu"), ("scale", 64**-0.5)],
    "mistral": [("windows", (None,) * 3)],
}


@pytest.fixture(scope="module")
def archs_dir(tmp_path_factory):
    with run_shared(tmp_path_factory, "archs") as folder:  # one folder per run, shared by xdist workers
        pass  # the lock is not held while tests run: archs.checkpoint writes each verifier atomically
    return folder


def _ids(v, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, v.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _engine_logits(model, ids: torch.Tensor, arch=None) -> torch.Tensor:
    """Logits of a prefill over the first PROMPT_LEN tokens, then one-token steps (the decode loop's calls)."""
    cache = engine.new_cache(engine.Engine(model, arch=arch), ids.shape[1])
    out = [engine.forward(cache, ids[:, :PROMPT_LEN]).logits]
    out += [engine.forward(cache, ids[:, j : j + 1]).logits for j in range(PROMPT_LEN, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", ENGINE_ARCHS)
def test_fp32_engine_equals_hugging_face(name, archs_dir):
    v = arch_verifier(name, archs_dir)
    ids = _ids(v, PROMPT_LEN + STEPS)
    with torch.no_grad():
        ref = v.model(ids, output_hidden_states=True)
    assert torch.allclose(_engine_logits(v.model, ids), ref.logits, atol=1e-4)
    cache = engine.new_cache(v.model, ids.shape[1])
    hidden = engine.forward(cache, ids, hidden_layers=[0, 1, -1]).hidden
    assert torch.allclose(hidden, torch.cat([ref.hidden_states[i] for i in (0, 1, -1)], dim=-1), atol=1e-4)
    # Greedy through the engine emits what HF's plain greedy (a full forward per token, no cache) emits.
    prompt = v.tokenizer("The capital of France is", return_tensors="pt").input_ids
    ours = greedy_decode(v, prompt, MAX_NEW, engine="engine").tokens[0].tolist()
    seq = prompt
    with torch.no_grad():
        for _ in range(MAX_NEW):
            seq = torch.cat([seq, v.model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert ours == seq[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_special_piece_matters(name, archs_dir):
    """Negative control: the same model run with its description missing one piece leaves HF's logits."""
    v = arch_verifier(name, archs_dir)
    ids = _ids(v, PROMPT_LEN + STEPS)
    with torch.no_grad():
        ref = v.model(ids).logits
    arch = describe(v.model.config)
    for field, value in BROKEN[name]:
        broken = dataclasses.replace(arch, **{field: value})
        assert (_engine_logits(v.model, ids, broken) - ref).abs().max() > 1e-3, f"{name} without its {field}"


@pytest.mark.parametrize("name", ENGINE_ARCHS)
def test_bf16_speculative_equals_plain_greedy(name, archs_dir):
    v = arch_verifier(name, archs_dir, dtype="bfloat16")
    assert use_engine(v)  # auto: the exact engine runs this architecture in bf16
    tree = from_medusa_choices(SPARSE)
    taus, scattered = [], False
    for seed, prompt in enumerate(["Hello, my name is", "def fib(n):\n    return"]):
        ids = v.tokenizer(prompt, return_tensors="pt").input_ids
        ref = greedy_decode(v, ids, MAX_NEW).tokens[0].tolist()
        oracle = Oracle(v, ids.shape[1], ref, tree, seed=seed)
        result = speculative_decode(v, oracle, ids, MAX_NEW)
        assert result.tokens[0].tolist() == ref  # greedy_match 1.0
        taus.append(result.tau)
        scattered |= oracle.scattered
    assert min(taus) > 1.5 and scattered, (taus, scattered)  # accepted paths ran through other branches


def test_other_architectures_fall_back_to_hugging_face_by_name(archs_dir, capsys):
    v = arch_verifier("qwen3_moe", archs_dir, dtype="bfloat16")
    with pytest.raises(Unsupported, match="model_type='qwen3_moe'"):
        describe(v.model.config)
    assert not use_engine(v)  # auto falls back...
    assert "model_type='qwen3_moe'" in (fallback_note(v.model.config) or "")  # ...saying which architecture
    with pytest.raises(Unsupported, match="hf_forward"):
        engine.Engine(v.model)  # engine=engine refuses it, naming the path that runs it
    # The fallback is exact where HF's forward is (fp32 on a CPU): speculative equals plain greedy.
    v32 = arch_verifier("qwen3_moe", archs_dir)
    ids = v32.tokenizer("Hello, my name is", return_tensors="pt").input_ids
    ref = greedy_decode(v32, ids, 24).tokens[0].tolist()
    oracle = Oracle(v32, ids.shape[1], ref, from_medusa_choices(SPARSE))
    assert speculative_decode(v32, oracle, ids, 24).tokens[0].tolist() == ref


def test_unsupported_rotary_is_named():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                "factor": 2.0})
    with pytest.raises(Unsupported, match="rope_type='dynamic'"):
        describe(config)

"""Long prompts: the prefill runs at matmul speed (eval.engine.forward._prefill: one kernel call per weight, SDPA), is
deterministic, and leaves the cache every later forward reads, so speculative decoding stays token for token plain
greedy decoding on prompts up to the verifier's window, in bf16 and fp32, every family and tree. The tiny varied
verifier has a 2,048-token window; the longest prompt here fills it but for the answer and the tree."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from test_exact_bf16 import SPARSE, Oracle, random_eagle, random_medusa

from eval.drafters.lookup import PromptLookupDrafter
from eval.engine import forward as engine
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import AutoTree, Chain, DynamicTree, chain, from_medusa_choices
from models.verifiers.core import Verifier
from models.verifiers.tiny import build_tiny

MAX_NEW = 24
pytestmark = pytest.mark.usefixtures("one_thread")


def _verifier(dtype: str) -> Verifier:
    return build_tiny(cache_dir=os.environ.get("SPECDRAFT_CACHE"), dtype=dtype, device="cpu", seed=1, layer_std=0.3)


@pytest.fixture(scope="module")
def bf16() -> Verifier:
    return _verifier("bfloat16")


@pytest.fixture(scope="module")
def fp32() -> Verifier:
    return _verifier("float32")


def long_prompt(verifier: Verifier, tokens: int) -> torch.Tensor:
    """`tokens` tokens of real text (Python's own source: code repeats itself, so prompt lookup finds matches)."""
    text = inspect.getsource(inspect) + inspect.getsource(os)
    ids = verifier.tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    assert ids.shape[1] == tokens
    return ids


def near_window(verifier: Verifier) -> int:
    """The longest prompt the window leaves room for: the answer and a tree of 64 nodes (eval.engine.decode's room)."""
    return verifier.config.max_position_embeddings - MAX_NEW - 64


def test_the_prefill_is_deterministic_and_close_to_hugging_face(bf16, fp32):
    for v in (bf16, fp32):
        ids = long_prompt(v, 1500)
        caches = [engine.new_cache(v.model, 1600) for _ in range(2)]
        outs = [engine.forward(c, ids, hidden_layers=[0, 1, -1]) for c in caches]
        assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
        assert torch.equal(caches[0].kv, caches[1].kv) and caches[0].length == 1500
        last = engine.forward(engine.new_cache(v.model, 1600), ids, last_logits=True).logits
        # the head over one row, not 1,500: the same product up to its kernel's summation order and output rounding
        full = outs[0].logits[:, -1].float()
        assert last.shape[1] == 1 and torch.allclose(last[:, -1].float(), full, atol=float(full.abs().max()) / 32)
        with torch.no_grad():
            ref = v.model(ids).logits.float()
        tol = 1e-3 if v is fp32 else 0.1 * float(ref.abs().max())  # bf16: rounding of a different summation order
        assert torch.allclose(outs[0].logits.float(), ref, atol=tol)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_prompt_near_the_window_decodes_exactly(dtype, bf16, fp32):
    v = bf16 if dtype == "bfloat16" else fp32
    ids = long_prompt(v, near_window(v))
    ref = greedy_decode(v, ids, MAX_NEW, engine="engine")
    assert ref.tokens.shape[1] == MAX_NEW
    for drafter in (random_medusa(v, from_medusa_choices(SPARSE)), random_eagle("eagle3", v, DynamicTree(size=16)),
                    PromptLookupDrafter(Chain(10), 10, 3, 1)):
        out = speculative_decode(v, drafter, ids, MAX_NEW, engine="engine")
        assert torch.equal(out.tokens, ref.tokens), type(drafter).__name__


TREES = {"medusa-chain": lambda v: random_medusa(v, Chain()),
         "medusa-sparse": lambda v: random_medusa(v, from_medusa_choices(SPARSE)),
         "eagle-chain": lambda v: random_eagle("eagle", v, Chain(4)),
         "eagle-auto": lambda v: random_eagle("eagle", v, AutoTree(12)),
         "eagle3-dynamic": lambda v: random_eagle("eagle3", v, DynamicTree()),
         "prompt-lookup": lambda v: PromptLookupDrafter(Chain(10), 10, 3, 1)}


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("engine_name", ["engine", "auto"])
def test_every_family_and_tree_is_exact_on_a_long_prompt(name, engine_name, bf16, fp32):
    """bf16 through the engine; fp32 through the engine and (auto) through HF's forward."""
    for v in (bf16, fp32):
        if engine_name == "auto" and v is bf16:
            continue  # auto is the engine in bf16: covered
        ids = long_prompt(v, 760)
        ref = greedy_decode(v, ids, MAX_NEW, engine=engine_name)
        out = speculative_decode(v, TREES[name](v), ids, MAX_NEW, engine=engine_name)
        assert torch.equal(out.tokens, ref.tokens), (name, str(v.model.dtype))


def test_the_prefill_with_attention_in_the_model_dtype_is_exact_and_takes_effect(bf16):
    """Engine.prefill_attention = "model" (what scripts.bench.long times beside the fp32 default): the prefill's
    attention over bf16 q, k, v changes the cache it leaves (the setting takes effect), stays close to the fp32 one,
    and speculative decoding is still plain greedy's token for token (both run the same prefill)."""
    from eval.engine.session import engine_of

    e = engine_of(bf16.model)
    ids = long_prompt(bf16, 900)
    caches = {}
    try:
        for attention in ("fp32", "model"):
            e.prefill_attention = attention
            caches[attention] = engine.new_cache(e, 1000)
            engine.forward(caches[attention], ids, last_logits=True)
        assert not torch.equal(caches["fp32"].kv, caches["model"].kv)
        ref = caches["fp32"].kv.float()
        assert torch.allclose(caches["model"].kv.float(), ref, atol=0.1 * float(ref.abs().max()))
        plain = greedy_decode(bf16, ids, MAX_NEW, engine="engine")
        for drafter in (random_medusa(bf16, from_medusa_choices(SPARSE)), PromptLookupDrafter(Chain(10), 10, 3, 1)):
            out = speculative_decode(bf16, drafter, ids, MAX_NEW, engine="engine")
            assert torch.equal(out.tokens, plain.tokens), type(drafter).__name__
    finally:
        e.prefill_attention = "auto"


def test_the_prefill_attention_auto_takes_bf16_only_where_it_is_clearly_faster(bf16, fp32):
    """`prefill_attention_for` on given times (what each choice's attention takes here): the model's dtype only
    where it is at least PREFILL_MARGIN faster (so a machine where the two tie keeps fp32 from one process to the
    next), fp32 for an fp32 model whatever the times, an explicit setting as set; a given timer leaves the
    process's memo alone."""
    from eval.engine.session import engine_of

    e = engine_of(bf16.model)
    times = lambda model_s: (lambda choice: model_s if choice == "model" else 1.0)  # noqa: E731
    memo = dict(engine._PREFILL_ATTENTION)
    assert engine.prefill_attention_for(e, times(0.5)) == "model"  # AMX-like: bf16 attention 2x fp32's
    assert engine.prefill_attention_for(e, times(1.0 / engine.PREFILL_MARGIN - 0.01)) == "model"
    assert engine.prefill_attention_for(e, times(0.95)) == "fp32"  # a tie within noise: fp32 stays
    assert engine.prefill_attention_for(e, times(1.3)) == "fp32"
    assert engine.prefill_attention_for(engine_of(fp32.model), times(0.1)) == "fp32"
    try:
        e.prefill_attention = "model"
        assert engine.prefill_attention_for(e, times(5.0)) == "model"
    finally:
        e.prefill_attention = "auto"
    assert engine._PREFILL_ATTENTION == memo


@pytest.mark.parametrize("picked", ["fp32", "model"])
def test_the_prefill_runs_the_attention_auto_picked_and_picks_it_before_the_prompt(picked, bf16):
    """Under the default "auto", a cache is made only after the choice is timed (so no timed prefill pays it), and
    the prefill then leaves the very cache the picked setting leaves, bit for bit, whichever this machine picked."""
    from eval.engine.session import engine_of

    e = engine_of(bf16.model)
    assert e.prefill_attention == "auto"
    key = (e.dtype, torch.get_num_threads(), e.num_heads, e.num_kv_heads, e.head_dim, "cpu")
    saved = engine._PREFILL_ATTENTION.pop(key, None)
    try:
        engine.new_cache(e, 128)
        assert engine._PREFILL_ATTENTION[key] in ("fp32", "model")  # timed when the cache was made
        engine._PREFILL_ATTENTION[key] = picked  # as if this machine had picked it
        ids = long_prompt(bf16, 700)
        caches = {}
        for setting in ("auto", picked):
            e.prefill_attention = setting
            caches[setting] = engine.new_cache(e, 800)
            engine.forward(caches[setting], ids, last_logits=True)
        assert torch.equal(caches["auto"].kv, caches[picked].kv)
    finally:
        e.prefill_attention = "auto"
        engine._PREFILL_ATTENTION.pop(key, None)
        if saved is not None:
            engine._PREFILL_ATTENTION[key] = saved


def test_accepted_paths_through_every_branch_after_a_long_prefill(bf16):
    ids = long_prompt(bf16, 900)
    ref = greedy_decode(bf16, ids, MAX_NEW + 8).tokens[0].tolist()
    for tree in (chain(4), from_medusa_choices(SPARSE)):
        oracle = Oracle(bf16, ids.shape[1], ref, tree, seed=3)
        result = speculative_decode(bf16, oracle, ids, MAX_NEW)
        assert result.tokens[0].tolist() == ref[:MAX_NEW] and result.tau > 1.5


@pytest.mark.slow
def test_the_builtin_set_has_a_long_context_category(smollm2):
    """At least 20 eval prompts of 700+ tokens after the default verifier's chat template, none matching a training
    prompt, each naming its source; rebuilt the same from Python's own text by scripts/tools/long_prompts.py."""
    import json
    import sys

    from data.chat import prompt_ids
    from data.filters import EvalGuard
    from data.prompts import BUILTIN_PATH, load_conversations
    from scripts.tools.long_prompts import CATEGORY, build

    long = [c for c in load_conversations("builtin", split="eval") if c.category == CATEGORY]
    assert len(long) >= 20
    lengths = [len(prompt_ids(smollm2.tokenizer, [{"role": "user", "content": c.user_turns[0]}])) for c in long]
    assert min(lengths) >= 700, lengths
    guard = EvalGuard([t for c in load_conversations("builtin", split="train") for t in c.user_turns])
    assert not any(guard.contaminated(c.user_turns[0]) for c in long)
    assert guard.contaminated(load_conversations("builtin", split="train")[0].user_turns[0])  # the guard sees one
    stored = [json.loads(line) for line in BUILTIN_PATH.read_text().splitlines() if CATEGORY in line]
    assert all(r["split"] == "eval" and r["source"] for r in stored)
    if all(f"python {sys.version_info.major}.{sys.version_info.minor} " in r["source"] for r in stored):
        assert build(smollm2.tokenizer) == stored  # the same Python: the same text

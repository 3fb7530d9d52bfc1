"""eval.engine.forward: the same logits as Hugging Face in fp32, and batch-invariant bits: a forward over n tokens, a
tree forward and its commit give exactly what n one-token forwards give, in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from eval.engine import forward as engine
from eval.engine import hf_forward as kv
from eval.engine.tree import chain, from_medusa_choices, tree_buffers
from runtime.errors import UserError
from tests.conftest import varied_llama

pytestmark = pytest.mark.usefixtures("one_thread")

CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (3,)]


@pytest.fixture(scope="module")
def varied():
    return varied_llama()


@pytest.fixture(scope="module")
def varied_bf16():
    v = varied_llama()
    v.model.to(torch.bfloat16)
    return v


def _ids(v, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, v.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _chain_and_steps(model, ids: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ids[prefix:] from one forward, and from one forward per token, after the same prefill."""
    a, b = engine.new_cache(model, ids.shape[1]), engine.new_cache(model, ids.shape[1])
    engine.forward(a, ids[:, :prefix])
    engine.forward(b, ids[:, :prefix])
    chained = engine.forward(a, ids[:, prefix:]).logits
    steps = [engine.forward(b, ids[:, j : j + 1]).logits for j in range(prefix, ids.shape[1])]
    return chained, torch.cat(steps, dim=1)


@pytest.mark.parametrize("which", ["tiny", "varied"])
def test_fp32_logits_and_hidden_layers_match_hugging_face(which, tiny, varied):
    v = tiny if which == "tiny" else varied
    ids = _ids(v, 20)
    with torch.no_grad():
        ref = v.model(ids, output_hidden_states=True)
    cache = engine.new_cache(v.model, 40)
    out = engine.forward(cache, ids[:, :12], hidden_layers=[0, 1, -1])
    assert torch.allclose(out.logits, ref.logits[:, :12], atol=1e-4)
    want = torch.cat([ref.hidden_states[i][:, :12] for i in (0, 1, -1)], dim=-1)
    assert torch.allclose(out.hidden, want, atol=1e-4)
    # The rest as a tree through the HF path and ours: same logits at every node.
    buf = tree_buffers(from_medusa_choices(CHOICES))
    nodes = _ids(v, buf.mask.shape[0], seed=5)
    hf_cache = kv.new_cache()
    kv.forward(v.model, hf_cache, ids[:, :12])
    hf_tree = kv.forward(v.model, hf_cache, nodes, buf.positions, buf.mask)
    ours = engine.forward(cache, nodes, buf.positions, buf.mask)
    assert torch.allclose(ours.logits, hf_tree.logits, atol=1e-4)
    assert torch.allclose(ours.hidden, hf_tree.hidden, atol=1e-4)


@pytest.mark.parametrize("which", ["tiny", "tiny_bf16", "varied", "varied_bf16"])
def test_one_forward_over_n_tokens_gives_the_bits_of_n_steps(which, tiny, varied, varied_bf16):
    v = {"tiny": tiny, "varied": varied, "varied_bf16": varied_bf16}.get(which)
    if which == "tiny_bf16":
        from models.verifiers.tiny import build_tiny

        v = build_tiny(dtype="bfloat16", device="cpu")
    ids = _ids(v, 30, seed=1)
    chained, steps = _chain_and_steps(v.model, ids, 10)
    assert torch.equal(chained, steps)


@pytest.mark.parametrize("which", ["tiny", "varied", "varied_bf16"])
def test_trimmed_far_keys_give_the_bits_of_the_whole_cache(which, tiny, varied, varied_bf16):
    """Forwards read the far keys only up to the last 64-slot block they reach (far_keys): a prefill, a chain of 110
    tokens across two block boundaries, the same tokens one step at a time and a tree give exactly the bits of
    the same forwards over the whole cache (trim=False)."""
    v = {"tiny": tiny, "varied": varied, "varied_bf16": varied_bf16}[which]
    ids = _ids(v, 150, seed=3)
    tree = from_medusa_choices(CHOICES)
    buf = tree_buffers(tree)
    out = {}
    for trim in (True, False):
        a, b = (engine.new_cache(v.model, 320, trim=trim) for _ in range(2))
        assert a.trim_keys == (trim and engine.trimmed_keys_invariant(a.engine, 320, a.min_rows))
        pre = engine.forward(a, ids[:, :40]).logits
        engine.forward(b, ids[:, :40])
        chained = engine.forward(a, ids[:, 40:]).logits
        steps = torch.cat([engine.forward(b, ids[:, j : j + 1]).logits for j in range(40, 150)], dim=1)
        nodes = engine.forward(a, ids[:, 30 : 30 + tree.num_nodes], buf.positions, buf.mask).logits  # at 150
        out[trim] = (pre, chained, steps, nodes)
        if trim:
            assert a.trim_keys  # this machine's kernels pass the probe; else the test only shows trim=False
            assert [engine.far_keys(a, p) for p in (40, 79, 80, 143, 144, 400)] == [64, 64, 128, 128, 192, 320]
    for x, y in zip(out[True], out[False]):
        assert torch.equal(x, y)
    assert torch.equal(out[True][1], out[True][2])


def test_trimmed_keys_probe_refuses_a_length_dependent_sum(varied, monkeypatch):
    """Negative control: an attention whose result depends on how many key blocks it reads (a sum whose order
    follows the length) must make the probe keep the whole cache."""
    e = engine.Engine(varied.model)
    real = engine._attend

    def length_dependent(q, kv, far_len, *rest):
        return real(q, kv, far_len, *rest) * (1 + 1e-6 * far_len / engine.KEY_BLOCK)

    monkeypatch.setattr(engine, "_attend", length_dependent)
    monkeypatch.setattr(engine, "_TRIM", {})
    assert not engine.trimmed_keys_invariant(e, 256, 2)
    assert not engine.new_cache(e, 256).trim_keys


class _AboveOneCall(engine.Linear):
    """As oneDNN's bf16 kernels on an AMX CPU: one rounding for calls of 1-32 rows, another above."""

    def _kernel(self, rows):
        y = super()._kernel(rows)
        return y if rows.shape[0] <= 32 else y * (1 + 2**-20)


class _EachCountItsOwn(engine.Linear):
    """In calls of up to 32 rows each row rounds by its place in the call (no split works); from 33 rows one path."""

    def _kernel(self, rows):
        y = super()._kernel(rows)
        place = torch.arange(rows.shape[0], dtype=y.dtype)[:, None]
        return y if rows.shape[0] > 32 else y * (1 + place * 2**-20)


@pytest.mark.parametrize(
    "kernel, rows, outside",
    [(_AboveOneCall, 32, (1, None)), (_EachCountItsOwn, None, (1, 32))],
    ids=["split-above-32", "pad-to-33"],
)
def test_weights_keep_to_the_row_counts_their_kernel_is_invariant_over(varied, monkeypatch, kernel, rows, outside):
    """A kernel whose rounding depends on the call's row count: the probe finds the range over which it does not
    (split calls above 32 rows, or pad every call to 33), `Linear` keeps every call inside it, and a 40-token forward
    then gives the bits of 40 one-token steps, and of the real kernel's where it runs the real kernel's path.
    Negative control: calls kept to a range the stand-in kernel itself rounds differently over (`outside`: no
    split for the first, no padding for the second) break it, whatever the machine's own kernel does (on a kernel
    that is batch-invariant by itself, as fp32 on a CPU without AMX can be, "calls as they come" would not)."""
    ids = _ids(varied, 60, seed=2)
    ref_chained, ref_steps = _chain_and_steps(varied.model, ids, 20)
    real = engine.Engine(varied.model).weight_rows  # the real kernel's own padding (fp32 here: a few rows)
    monkeypatch.setattr(engine, "Linear", kernel)
    monkeypatch.setattr(engine, "_LINEAR_ROWS", {})
    e = engine.Engine(varied.model)
    if rows == 32:  # the real kernel's padding, and calls split at 32 rows
        assert e.weight_rows == {name: (lo, 32) for name, (lo, _) in real.items()}
    else:  # no split of 16+ rows works: every call padded to 33
        assert e.weight_rows == {name: (33, None) for name in real}
    chained, steps = _chain_and_steps(e, ids, 20)
    assert torch.equal(chained, steps)
    if kernel is _AboveOneCall:  # every call within 1-32 rows: the real kernel's bits
        assert torch.equal(steps, ref_steps) and torch.equal(chained, ref_chained)
    for name in real:
        e.keep_rows(name, outside)
    chained, steps = _chain_and_steps(e, ids, 20)
    assert not torch.equal(chained, steps)


def test_linear_splits_and_pads_calls_and_returns_only_their_rows():
    """`Linear` with min_rows 3 and max_rows 4: 1 row runs in a call of 3; 10 rows in calls of 4, 4 and 2 (padded to
    3); every row gets what F.linear gives it, in order."""
    calls = []

    class Recording(engine.Linear):
        def _kernel(self, rows):
            calls.append(rows.shape[0])
            return super()._kernel(rows)

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(5, 7, generator=g), torch.randn(5, generator=g)
    lin = Recording(w, b, False, min_rows=3, max_rows=4)
    for shape, expected in [((1, 1, 7), [3]), ((2, 5, 7), [4, 4, 3]), ((1, 4, 7), [4])]:
        calls.clear()
        x = torch.randn(*shape, generator=g)
        y = lin(x)
        assert y.shape == shape[:-1] + (5,) and torch.allclose(y, torch.nn.functional.linear(x, w, b), atol=1e-6)
        assert calls == expected


@pytest.mark.parametrize("which", ["varied", "varied_bf16"])
def test_every_pad_row_count_gives_the_same_bits(which, varied, varied_bf16):
    """Short forwards are padded to `pad_rows`, the fastest count from min_rows up: each candidate it may choose
    gives the bits of the smallest, for one-token steps and for a 3-token chain."""
    v = varied if which == "varied" else varied_bf16
    ids = _ids(v, 24, seed=3)
    runs = {}
    for rows in [r for r in engine._PROBE_ROWS if r <= engine.MAX_PAD_ROWS]:
        cache = engine.new_cache(v.model, 24)
        if rows < cache.min_rows:
            continue
        cache.pad_rows = rows
        engine.forward(cache, ids[:, :12])
        steps = [engine.forward(cache, ids[:, j : j + 1]).logits for j in range(12, 21)]
        runs[rows] = torch.cat([*steps, engine.forward(cache, ids[:, 21:]).logits], dim=1)
    assert len(runs) >= 3
    first = runs[min(runs)]
    assert all(torch.equal(out, first) for out in runs.values())


def test_fastest_takes_the_least_time_interleaved():
    calls = []

    def seconds(rows: int) -> float:
        calls.append(rows)
        return {2: 0.041, 3: 0.037, 4: 0.037, 5: 0.040}[rows] + (0.05 if len(calls) == 7 else 0.0)  # one slow burst

    assert engine.fastest([2, 3, 4, 5], seconds) == 3  # least time; the tie 3 / 4 goes to fewer rows
    assert calls[:8] == [2, 3, 4, 5, 2, 2, 3, 3]  # a warm call each, then rounds over every candidate in turn


@pytest.mark.parametrize("which", ["varied", "varied_bf16"])
def test_tree_forward_and_commit_give_the_bits_of_a_plain_forward(which, varied, varied_bf16):
    v = varied if which == "varied" else varied_bf16
    tree = from_medusa_choices(CHOICES)
    buf = tree_buffers(tree)
    prefix, nodes = _ids(v, 13, seed=2), _ids(v, tree.num_nodes, seed=3)
    size = prefix.shape[1] + tree.num_nodes + 1

    def plain(path: torch.Tensor):
        cache = engine.new_cache(v.model, size)
        engine.forward(cache, prefix)
        return cache, engine.forward(cache, nodes[:, path])

    cache = engine.new_cache(v.model, size)
    engine.forward(cache, prefix)
    out = engine.forward(cache, nodes, buf.positions, buf.mask, hidden_layers=[1, -1])
    for row in buf.retrieve:  # every root-to-leaf path, off the first branch included
        path = row[row >= 0]
        _, ref = plain(path)
        assert torch.equal(out.logits[:, path], ref.logits)
    path = buf.retrieve[-2][buf.retrieve[-2] >= 0]  # (1,0,0): nodes scattered after the prefix
    assert path.tolist() != list(range(len(path)))
    engine.commit(cache, prefix.shape[1], path[None])
    ref_cache, _ = plain(path)
    assert engine.cache_length(cache) == engine.cache_length(ref_cache) == prefix.shape[1] + len(path)
    n = engine.cache_length(cache)
    assert torch.equal(cache.k[:, :, :, :n], ref_cache.k[:, :, :, :n])
    assert torch.equal(cache.v[:, :, :, :n], ref_cache.v[:, :, :, :n])
    nxt = torch.tensor([[321]])
    assert torch.equal(engine.forward(cache, nxt).logits, engine.forward(ref_cache, nxt).logits)


def test_errors_name_the_size_and_the_fix(tiny):
    cache = engine.new_cache(tiny.model, 8)  # rounded up to one key block
    with pytest.raises(UserError, match="holds 64 tokens"):
        engine.forward(cache, _ids(tiny, 65))
    buf = tree_buffers(chain(engine.WINDOW))
    with pytest.raises(UserError, match="deep"):
        engine.forward(cache, _ids(tiny, engine.WINDOW + 1), buf.positions, buf.mask)
    with pytest.raises(UserError, match="do not describe a tree"):
        engine.forward(cache, _ids(tiny, 3), torch.tensor([0, 1, 1]), torch.ones(3, 3, dtype=torch.bool))


def test_refuses_a_verifier_whose_block_it_does_not_run():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # a mixture of experts: not in eval.engine.arch

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2)
    with pytest.raises(UserError, match="model_type='qwen3_moe'"):
        engine.new_cache(Qwen3MoeForCausalLM(config), 8)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's prepacked linear needs mkldnn")
def test_bf16_prepacked_weights_compute_the_same_layer_with_biases():
    """In bf16 on CPU the engine runs every weight through oneDNN's prepacked kernel; it must compute the same
    model as F.linear on the plain weights (biases included: a Qwen2 block with large q/k/v biases), and the
    batch-invariance probe must have run on that kernel."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 1.0)
    model.to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    out = {}
    for pack in (True, False):
        e = engine.Engine(model, pack=pack)
        assert e.pack is pack and e.layers[0]["qkv"].packed is pack and e.lm_head.packed is pack
        cache = engine.new_cache(e, 32)
        assert (e.dtype, 64, 128, True) in {k[:4] for k in engine._LINEAR_ROWS} or not pack  # probed on it
        out[pack] = torch.cat([engine.forward(cache, ids[:, :20]).logits,
                               engine.forward(cache, ids[:, 20:21]).logits], 1)
    with torch.no_grad():
        ref = model.float()(ids[:, :21]).logits
    err_packed = (out[True].float() - ref).abs().max()
    err_plain = (out[False].float() - ref).abs().max()
    assert err_packed <= 2 * err_plain + 1e-3, (err_packed, err_plain)
    assert torch.allclose(out[True].float(), out[False].float(), atol=0.1, rtol=0.02)


@pytest.mark.slow
def test_default_verifier_bf16_chain_and_tree_are_bitwise_the_steps(cache_dir):
    from models.verifiers.embedded import load_smollm2

    v = load_smollm2(cache_dir=cache_dir, dtype="bfloat16", device="cpu")
    ids = v.tokenizer(
        "Explain why the sky is blue in two sentences. Sunlight is made of many colours, and the molecules of the air "
        "scatter the short blue waves far more than the long red ones, so blue light reaches the eye from every side.",
        return_tensors="pt",
    ).input_ids
    assert ids.shape[1] > 41
    for n in (16, 40):  # one call of 16 rows; 40 rows, beyond the 32 over which AMX's bf16 kernels keep one path
        chained, steps = _chain_and_steps(v.model, ids, ids.shape[1] - n)
        assert torch.equal(chained, steps)
    tree = from_medusa_choices(CHOICES)
    buf = tree_buffers(tree)
    cache = engine.new_cache(v.model, ids.shape[1] + tree.num_nodes)
    engine.forward(cache, ids[:, :10])
    out = engine.forward(cache, ids[:, 10 : 10 + tree.num_nodes], buf.positions, buf.mask)
    path = buf.retrieve[-2][buf.retrieve[-2] >= 0]
    ref = engine.new_cache(v.model, ids.shape[1] + tree.num_nodes)
    engine.forward(ref, ids[:, :10])
    assert torch.equal(out.logits[:, path], engine.forward(ref, ids[:, 10 : 10 + tree.num_nodes][:, path]).logits)

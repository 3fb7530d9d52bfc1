"""The verifier's KV cache: tree forwards see the right tokens, and a commit leaves exactly the cache a plain
forward over prefix + accepted tokens would."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from eval.engine import hf_forward as kv
from eval.engine.tree import chain, from_medusa_choices, tree_buffers
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def verifier():
    return build_tiny(cache_dir=os.environ.get("SPECDRAFT_CACHE"), dtype="float32", device="cpu")


def _fresh(model, ids):
    cache = kv.new_cache()
    out = kv.forward(model, cache, ids)
    return cache, out


def _assert_caches_close(a, b):
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert la.keys.shape == lb.keys.shape
        assert torch.allclose(la.keys, lb.keys, atol=1e-5)
        assert torch.allclose(la.values, lb.values, atol=1e-5)


def test_commit_of_a_chain_equals_a_fresh_forward(verifier):
    model = verifier.model
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, verifier.vocab_size, (1, 10), generator=gen)
    drafts = torch.randint(0, verifier.vocab_size, (1, 5), generator=gen)
    cache, _ = _fresh(model, prefix)
    buf = tree_buffers(chain(4))
    kv.forward(model, cache, drafts, buf.positions, buf.mask)  # 5 drafts in a line after the 10-token prefix
    assert kv.cache_length(cache) == 15
    kv.commit(cache, 10, torch.tensor([[0, 1]]))  # accept the first 2, reject at the 3rd
    assert kv.cache_length(cache) == 12

    ref_cache, _ = _fresh(model, torch.cat([prefix, drafts[:, :2]], dim=1))
    _assert_caches_close(cache, ref_cache)
    nxt = torch.tensor([[123]])
    ours, ref = kv.forward(model, cache, nxt), kv.forward(model, ref_cache, nxt)
    assert torch.allclose(ours.logits, ref.logits, atol=1e-5)
    assert torch.allclose(ours.hidden, ref.hidden, atol=1e-5)


def test_commit_of_a_tree_path_gathers_non_contiguous_nodes(verifier):
    model = verifier.model
    tree = from_medusa_choices([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 0, 0)])
    buf = tree_buffers(tree)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, verifier.vocab_size, (1, 10), generator=gen)
    tokens = torch.randint(0, verifier.vocab_size, (1, tree.num_nodes), generator=gen)
    cache, _ = _fresh(model, prefix)
    kv.forward(model, cache, tokens, buf.positions, buf.mask)
    path = [0, 2, 4, 6]  # root -> (1,) -> (1,0) -> (1,0,0): nodes spread over the tree
    assert tree.paths[6] == (1, 0, 0) and tree.parents[6] == 4 and tree.parents[4] == 2
    kv.commit(cache, 10, torch.tensor([path]))

    ref_cache, _ = _fresh(model, torch.cat([prefix, tokens[:, path]], dim=1))
    _assert_caches_close(cache, ref_cache)
    nxt = torch.tensor([[7]])
    assert torch.allclose(kv.forward(model, cache, nxt).logits, kv.forward(model, ref_cache, nxt).logits, atol=1e-5)


def test_tree_forward_scores_each_node_as_its_own_path(verifier):
    # The tree mask and positions must make node i's outputs those of a plain forward over prefix + its path.
    model = verifier.model
    tree = from_medusa_choices([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0)])
    buf = tree_buffers(tree)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, verifier.vocab_size, (1, 6), generator=gen)
    tokens = torch.randint(0, verifier.vocab_size, (1, tree.num_nodes), generator=gen)
    cache, _ = _fresh(model, prefix)
    out = kv.forward(model, cache, tokens, buf.positions, buf.mask)
    for node in range(tree.num_nodes):
        path, i = [], node
        while i >= 0:
            path.append(i)
            i = tree.parents[i]
        _, ref = _fresh(model, torch.cat([prefix, tokens[:, path[::-1]]], dim=1))
        assert torch.allclose(out.logits[:, node], ref.logits[:, -1], atol=1e-5), node
        assert torch.allclose(out.hidden[:, node], ref.hidden[:, -1], atol=1e-5), node
        # The hidden state is the lm_head input: projecting it gives the logits.
        assert torch.allclose(verifier.lm_head(out.hidden[:, node]), out.logits[:, node], atol=1e-5)


def test_tree_bias_is_additive_and_shows_the_prefix():
    mask = tree_buffers(from_medusa_choices([(0,), (1,)])).mask
    bias = kv.tree_attention_bias(mask, prefix_len=2, dtype=torch.float32, batch_size=2)
    assert bias.shape == (2, 1, 3, 5)
    assert (bias[:, :, :, :2] == 0).all()
    assert ((bias[0, 0, :, 2:] == 0) == mask).all()
    assert (bias[0, 0, 1, 4] == torch.finfo(torch.float32).min).item()


def test_sliding_window_models_are_refused_past_the_window():
    config = MistralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=16,
    )
    model = MistralForCausalLM(config)
    kv.check_model(model, 16)
    with pytest.raises(UserError, match="sliding attention window of 16"):
        kv.check_model(model, 17)

"""P-EAGLE (models/peagle.py, train/peagle.py, eval/drafters/peagle.py): the training forward computes what decoding
computes, COD sampling keeps nested chains in the shares it promises, one forward drafts every depth, and bad input is
refused with a message."""

from __future__ import annotations

import pytest
import torch

from helpers import varied_llama
from models.peagle import PEagleNet, build_peagle, check_mask_token, cod_anchors, parallel_rows
from runtime.errors import UserError


@pytest.fixture(scope="module")
def varied():
    return varied_llama(seed=1)


def _net(verifier, parallel: int = 4) -> PEagleNet:
    torch.manual_seed(0)
    net = build_peagle(verifier, mask_token_id=16, parallel=parallel, aux_layer_ids=[0, 1]).float().eval()
    with torch.no_grad():
        net.mask_hidden.normal_(0, 1.0)  # a mask feature that matters, so a wrong key set shows in the outputs
    return net


def _features(verifier, net, ids):
    with torch.no_grad():
        states = verifier.model(ids, output_hidden_states=True).hidden_states
        return net.features({i: states[i] for i in net.aux_layer_ids})


@torch.no_grad()
def test_training_rows_are_what_decoding_computes(varied):
    """Depth d at anchor a in training (parallel_rows, every chain kept) = mask slot d after a context of a+1
    committed positions at decode time (PEagleNet.mask_slots over the drafter's step-0 keys), and step 0 = the
    drafter's output at the last committed position."""
    net = _net(varied)
    embed = varied.model.get_input_embeddings()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(20, 1000, (1, 40), generator=gen)
    n = ids.shape[1] - 1
    feats = _features(varied, net, ids)[:, :n]
    attn, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    rows = list(parallel_rows(net, feats, ids, attn, loss_mask, embed, 4, ratio=1.0, min_ratio=1.0,
                              max_anchors=None))
    assert len(rows) == 4
    for a in (0, 5, 17, n - 4):
        pos = torch.arange(a + 1)[None]
        causal = torch.ones(a + 1, a + 1, dtype=torch.bool).tril()[None, None]
        out, k, v = net.step(feats[:, : a + 1], embed(ids[:, 1 : a + 2]), pos, causal)
        assert torch.allclose(rows[0].out[0, a], out[0, a], atol=1e-5)
        slots = net.mask_slots(3, a + 1, k, v, embed)  # (1, 3, D)
        for d in (1, 2, 3):
            step = rows[d]
            at = ((step.batch == 0) & (step.position == a)).nonzero()
            if a + d + 2 > n:  # no target: no row
                assert at.numel() == 0
                continue
            col = step.column[at[0, 0]]
            assert torch.allclose(step.out[0, col], slots[0, d - 1], atol=1e-5), (a, d)


def test_cod_keeps_nested_chains_in_the_promised_shares():
    gen = torch.Generator().manual_seed(0)
    valid = [torch.rand(2, 400, generator=gen) < 0.9 for _ in range(5)]
    kept = cod_anchors(valid, ratio=0.7, min_ratio=0.2, max_anchors=None, generator=gen)
    assert len(kept) == 4
    seeds = valid[1].sum(-1)
    for d, k in enumerate(kept, start=1):
        assert bool((k <= valid[d]).all())
        if d > 1:
            assert bool((k <= kept[d - 2]).all())  # a chain reaches depth d only through depth d-1
        want = (seeds.float() * max(0.7**d, 0.2)).floor()
        assert bool((k.sum(-1).float() <= want).all()) and bool((k.sum(-1).float() >= want * 0.8).all())
    capped = cod_anchors(valid, 0.7, 0.2, max_anchors=10, generator=gen)
    assert int(capped[0].sum(-1).max()) == 10
    every = cod_anchors(valid, 1.0, 1.0, None)
    assert torch.equal(every[0], valid[1]) and torch.equal(every[1], valid[1] & valid[2])


@torch.no_grad()
def test_one_forward_drafts_every_depth(varied, monkeypatch):
    """A round of the drafter runs its layer twice: once over the newly committed positions, once over the mask
    slots, whatever the depth of its tree."""
    from eval.drafters.peagle import PEagleDrafter
    from eval.engine.tree import chain

    net = _net(varied, parallel=5)
    calls = []
    original = net.step
    monkeypatch.setattr(net, "step", lambda *a, **k: calls.append(a[0].shape[1]) or original(*a, **k))
    drafter = PEagleDrafter(net, varied, chain(5))
    ids = torch.randint(20, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    hidden = torch.cat([varied.model(ids, output_hidden_states=True).hidden_states[i] for i in (0, 1)], dim=-1)
    draft = drafter.propose(ids, hidden[:, :-1])
    assert draft.tokens.shape == (1, 6) and calls == [11, 4]


def test_bad_input_is_refused_with_a_message(varied, tmp_path):
    with pytest.raises(UserError, match=r"mask token must be a token id in 0\.\.49151"):
        check_mask_token(60000, 49152)
    with pytest.raises(UserError, match="window .* cannot hold a block of 4096"):
        build_peagle(varied, mask_token_id=16, parallel=4096, aux_layer_ids=[0, 1])
    with pytest.raises(UserError, match="parallel_tokens=0"):
        build_peagle(varied, mask_token_id=16, parallel=0, aux_layer_ids=[0, 1])


@torch.no_grad()
def test_the_planner_times_one_forward_over_the_depth_the_budget_buys(varied, monkeypatch):
    """A P-EAGLE round's drafting (its `trial`, which eval.planner.cost.draft_curve times) is the new features'
    forward, then one mask forward as deep as the tree tree.size=auto builds for the budget (none for a one-deep tree),
    whatever the
    probe drafter's own tree; EAGLE-3's grows a forward per depth. With the flatter draft curve that gives,
    tree.size=auto plans a tree at least as large as with a growing one on the same verifier curve and table."""
    from eval.drafters.eagle import EagleDrafter
    from eval.drafters.peagle import PEagleDrafter
    from eval.engine.tree import DynamicTree, auto_tree
    from eval.planner.cost import best_size
    from models.eagle import build_eagle

    ids = torch.randint(20, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    hidden = torch.cat([varied.model(ids, output_hidden_states=True).hidden_states[i] for i in (0, 1)], dim=-1)
    table = [[0.6, 0.7, 0.75, 0.78], [0.5, 0.6, 0.65, 0.68], [0.45, 0.55, 0.6, 0.63], [0.4, 0.5, 0.55, 0.58]]
    budgets = (1, 2, 4, 12)
    counts = {}
    for name, drafter in (("peagle", PEagleDrafter(_net(varied), varied, auto_tree(table, 63), table=table)),
                          ("eagle3", EagleDrafter(build_eagle("eagle3", varied, aux_layer_ids=[0, 1]), varied,
                                                  DynamicTree(size=12, depth=4, topk=4)))):
        # the prefill, then a round that accepted nothing (eval.planner.cost.draft_curve)
        drafter.propose(ids, hidden[:, :-1])
        drafter.accepted(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
        seq = torch.cat([ids, ids[:, -1:]], dim=1)
        calls = []
        original = drafter.net.step
        monkeypatch.setattr(drafter.net, "step", lambda *a, **k: calls.append(a[0].shape[1]) or original(*a, **k))
        counts[name] = []
        for drafts in budgets:
            calls.clear()
            tree = drafter.trial(seq, hidden[:, -1:], drafts)
            if name == "peagle":
                assert tree == auto_tree(table, drafts)
            counts[name].append(list(calls))
    # the new position's forward, then depth - 1 mask slots in one forward: depths 1, 2, 3, 4
    assert counts["peagle"] == [[1], [1, 1], [1, 2], [1, 3]]
    assert [auto_tree(table, s).max_depth for s in budgets] == [1, 2, 3, 4]
    assert len(counts["eagle3"][0]) < len(counts["eagle3"][-1])
    sizes, verify = [1, 8, 16, 32, 64], [10.0, 11.0, 12.0, 16.0, 26.0]
    flat = best_size(sizes, verify, table, draft=[3.0] * 5)
    growing = best_size(sizes, verify, table, draft=[3.0, 6.0, 9.0, 12.0, 15.0])
    assert flat.size >= growing.size and flat.predicted_speedup > growing.predicted_speedup


@pytest.mark.parametrize("model", ["peagle", "dflash"])
def test_a_mask_token_the_data_holds_is_refused(model, varied, monkeypatch, tmp_path):
    """Training refuses a mask token that is a training target (a mask slot would read as that token)."""
    from hydra.utils import instantiate

    from helpers import compose_train

    cfg = compose_train(["verifier=tiny", f"model={model}", "model.aux_layer_ids=[0,1]"], tmp_path)
    module = instantiate(cfg.model, verifier=varied)
    counts = torch.zeros(varied.vocab_size)
    counts[16] = 3
    monkeypatch.setattr(module, "count_targets", lambda vocab: counts)
    monkeypatch.setattr(module, "setup_train_vocab", lambda counts: None)
    with pytest.raises(UserError, match=r"mask_token_id=16 .* is a training target 3 times"):
        module.setup("fit")
    counts[16] = 0
    module.setup("fit")  # a token the data never holds passes

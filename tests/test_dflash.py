"""DFlash (models/dflash.py, train/dflash.py, eval/drafters/dflash.py): the training blocks compute what decoding
computes, a round is one block forward, and bad input is refused with a message."""

from __future__ import annotations

import pytest
import torch

from helpers import varied_llama
from models.dflash import DFlashNet, block_rows, build_dflash
from runtime.errors import UserError


@pytest.fixture(scope="module")
def varied():
    return varied_llama(seed=1)


def _net(verifier, block_size: int = 5) -> DFlashNet:
    torch.manual_seed(0)
    net = build_dflash(verifier, mask_token_id=16, block_size=block_size, num_layers=2, aux_layer_ids=[0, 1])
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return net.float().eval()


def _hidden(verifier, ids):
    states = verifier.model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in (0, 1)], dim=-1)


@torch.no_grad()
def test_training_blocks_are_what_decoding_computes(varied):
    """Slot k of the block whose context ends at t (training: block_rows, every anchor) = the drafter's depth-k logits
    after a prefill of positions 0..t with root x_{t+1} (eval: DFlashDrafter)."""
    from eval.drafters.dflash import DFlashDrafter
    from eval.engine.tree import chain

    net = _net(varied)
    embed = varied.model.get_input_embeddings()
    ids = torch.randint(20, 1000, (1, 40), generator=torch.Generator().manual_seed(3))
    n = ids.shape[1] - 1
    hidden = _hidden(varied, ids)
    feats = net.features({0: hidden[..., :64], 1: hidden[..., 64:]})[:, :n]
    ones = torch.ones_like(ids)
    steps = net.parallel
    rows = list(block_rows(net, feats, ids, ones, ones, embed, steps, num_anchors=None))
    assert len(rows) == steps
    for t in (0, 6, 17, n - steps - 1):
        drafter = DFlashDrafter(net, varied, chain(steps))
        drafter.propose(ids[:, : t + 2], hidden[:, : t + 1])
        assert drafter.cache_length == t + 1
        logits = drafter._depth_logits(None)  # (K, V)
        for j, step in enumerate(rows):
            at = ((step.batch == 0) & (step.position == t)).nonzero()
            assert at.numel() == 1, (t, j)
            ref = net.logits(step.out[0, step.column[at[0, 0]]][None], drafter.lm_head).float()[0]
            assert torch.allclose(logits[j], ref, atol=1e-3 * float(ref.abs().max())), (t, j)


@torch.no_grad()
def test_teacher_forced_scoring_ranks_what_decoding_would_draft(varied):
    """The registry's teacher-forced scorer for DFlash (eval.drafters.dflash.dflash_ranks, what eval.offline scores an
    export with): slot j's rank at position t is M_q's argmax t+j+1 ranked under the depth-j logits the decoding
    drafter computes after a prefill of 0..t; and eval.offline's tables come out of it for DFlash and DSpark."""
    from eval.drafters.dflash import DFlashDrafter
    from eval.engine.tree import chain
    from eval.offline import score_export
    from models.dspark import build_dspark
    from models.eagle import target_rank
    from models.families import FAMILIES, resolve

    net = _net(varied)
    ids = torch.randint(20, 1000, (1, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros_like(ids)
    mask[:, 4:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    ranks, valid, _ = resolve(FAMILIES["dflash"].teacher_forced)(net, varied, batch, net.parallel)
    hidden = _hidden(varied, ids)
    q_arg = varied.lm_head(varied.model(ids, output_hidden_states=True).hidden_states[-1]).argmax(-1)[0]
    for t in (6, 17):
        drafter = DFlashDrafter(net, varied, chain(net.parallel))
        drafter.propose(ids[:, : t + 2], hidden[:, : t + 1])
        logits = drafter._depth_logits(None)  # (K, V)
        for j in range(net.parallel):
            assert bool(valid[j, 0, t]), (t, j)
            want = int(target_rank(logits[j][None], q_arg[t + j + 1][None])[0])
            assert int(ranks[j, 0, t]) == want, (t, j)
    rows = [{"input_ids": ids[0].tolist(), "loss_mask": mask[0].tolist()}]
    torch.manual_seed(0)
    for kind, drafter_net in (("dflash", net), ("dspark", build_dspark(varied, 16, 5, 1, [0, 1]).float().eval())):
        tables = score_export(kind, drafter_net, varied, rows, depth=3)
        assert tables, kind


@torch.no_grad()
def test_a_round_is_one_block_forward(varied, monkeypatch):
    from eval.drafters.dflash import DFlashDrafter
    from eval.engine.tree import chain

    net = _net(varied, block_size=6)
    calls = []
    original = net.block
    monkeypatch.setattr(net, "block", lambda *a, **k: calls.append(a[0].shape[1]) or original(*a, **k))
    drafter = DFlashDrafter(net, varied, chain(5))
    ids = torch.randint(20, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    draft = drafter.propose(ids, _hidden(varied, ids)[:, :-1])
    assert draft.tokens.shape == (1, 6) and calls == [6]  # the root and 5 masks, once


@torch.no_grad()
def test_the_planner_times_the_block_the_budget_buys(varied, monkeypatch):
    """eval.planner.cost.draft_curve times `trial(s)`: one block over the depth of the tree tree.size=auto builds for s
    drafts from the export's table, not the block of the probe drafter's largest tree."""
    from eval.drafters.dflash import DFlashDrafter
    from eval.engine.tree import auto_tree

    net = _net(varied, block_size=6)
    table = [[0.6, 0.7, 0.75], [0.5, 0.6, 0.65], [0.45, 0.55, 0.6], [0.4, 0.5, 0.55], [0.3, 0.4, 0.45]]
    drafter = DFlashDrafter(net, varied, auto_tree(table, 63), table=table)  # the probe: the largest budget
    ids = torch.randint(20, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    hidden = _hidden(varied, ids)
    drafter.propose(ids, hidden[:, :-1])
    drafter.accepted(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    calls = []
    original = net.block
    monkeypatch.setattr(net, "block", lambda *a, **k: calls.append(a[0].shape[1]) or original(*a, **k))
    seq = torch.cat([ids, ids[:, -1:]], dim=1)
    for drafts in (1, 2, 12):
        calls.clear()
        assert drafter.trial(seq, hidden[:, -1:], drafts) == auto_tree(table, drafts)
        assert calls == [1 + auto_tree(table, drafts).max_depth]  # the root and that many masks, once
    assert auto_tree(table, 1).max_depth == 1 < auto_tree(table, 12).max_depth  # the budgets differ in depth


def test_bad_input_is_refused_with_a_message(varied):
    with pytest.raises(UserError, match="block_size=1"):
        build_dflash(varied, 16, block_size=1, aux_layer_ids=[0, 1])
    with pytest.raises(UserError, match="cannot hold a block of 4096"):
        build_dflash(varied, 16, block_size=4096, aux_layer_ids=[0, 1])
    with pytest.raises(UserError, match=r"mask token must be a token id in 0\.\.49151"):
        build_dflash(varied, 49152, aux_layer_ids=[0, 1])


def test_a_tree_shape_it_cannot_draft_names_dflash(varied):
    """The shared fixed-tree builder (eval.engine.tree.fixed_tree) speaks of the drafter it builds for."""
    from eval.drafters.dflash import dflash_drafter
    from eval.engine.tree import AutoTree, Chain, DynamicTree

    net = _net(varied)
    with pytest.raises(UserError, match="does not fit a DFlash drafter"):
        dflash_drafter(net, {}, varied, DynamicTree())
    with pytest.raises(UserError, match="eagle_topk_accuracy.*this DFlash export has none"):
        dflash_drafter(net, {}, varied, AutoTree())
    assert dflash_drafter(net, {}, varied, Chain()).max_nodes == 5


@torch.no_grad()
def test_an_export_trained_over_frequent_rows_drafts_over_them_exactly(varied, tmp_path):
    """An export trained with `model.train_vocab=N` (the N most frequent targets' rows of the verifier's head) drafts
    over those rows, as training scored them, and decoding stays exact; without it, other tokens get drafted."""
    from eval.drafters.build import make_drafter
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.tree import Chain
    from models.exports.io import save_export

    net, vocab = _net(varied), varied.vocab_size
    counts = torch.rand(vocab, generator=torch.Generator().manual_seed(0))
    ids = counts.topk(vocab // 8).indices.sort().values
    lean = save_export(net, varied, tmp_path / "lean", {"train_vocab": vocab // 8}, target_counts=counts)
    full = save_export(net, varied, tmp_path / "full", target_counts=counts)
    drafted = {}
    for name, path in (("lean", lean), ("full", full)):
        drafter = make_drafter("dflash", varied, Chain(4), checkpoint=path)
        seen, propose = set(), drafter.propose

        def spy(*args, propose=propose, seen=seen):
            draft = propose(*args)
            seen.update(draft.tokens[0, 1:].tolist())
            return draft

        drafter.propose = spy
        for prompt in ("The capital of France is", "def add(a, b):"):
            prompt_ids = varied.tokenizer(prompt, return_tensors="pt").input_ids
            want = greedy_decode(varied, prompt_ids, 24).tokens[0].tolist()
            assert speculative_decode(varied, drafter, prompt_ids, 24).tokens[0].tolist() == want, (name, prompt)
        drafted[name] = seen
    assert torch.equal(make_drafter("dflash", varied, Chain(4), checkpoint=lean).head_ids, ids)
    assert drafted["lean"] and drafted["lean"] <= set(ids.tolist())
    assert not drafted["full"] <= set(ids.tolist())

"""DSpark (models/dspark.py, train/dspark.py, eval/drafters/dspark.py): the training slots compute what drafting
computes (teacher-forced on the previous token), every draft conditions on the one drafted before it, the confidence
head learns each slot's acceptance and cuts the proposal, greedy output is plain greedy's, the export is the layout
vLLM's dspark reads, and bad input is refused with one message each."""

from __future__ import annotations

import json
import math
from functools import partial

import pytest
import torch

from helpers import varied_llama
from models.dspark import DSparkNet, build_dspark
from runtime.errors import UserError


@pytest.fixture(scope="module")
def varied():
    return varied_llama(seed=1)


def _net(verifier, head_type: str = "vanilla", block_size: int = 5, rank: int = 16) -> DSparkNet:
    torch.manual_seed(0)
    net = build_dspark(verifier, mask_token_id=16, block_size=block_size, num_layers=2, aux_layer_ids=[0, 1],
                       markov_rank=rank, markov_head_type=head_type)
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
        net.markov_head.markov_w1.weight.normal_(0, 1.0)  # a bias strong enough to change drafts
        net.markov_head.markov_w2.weight.normal_(0, 1.0)
    return net.float().eval()


def _hidden(verifier, ids):
    states = verifier.model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in (0, 1)], dim=-1)


def _ids(n: int = 40, seed: int = 3):
    return torch.randint(20, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
@torch.no_grad()
def test_training_slots_are_what_drafting_computes(varied, head_type, one_thread):
    """Slot k of the block whose context ends at t (training: block_rows + slot_bias, teacher-forced on x_{t+k}) =
    the drafter's depth-k logits and confidence after a prefill of 0..t, root x_{t+1}, when the drafts before it are
    x_{t+2}..x_{t+k}."""
    from eval.drafters.dspark import DSparkDrafter
    from eval.engine.tree import chain
    from models.dflash import block_rows
    from train.dspark import slot_bias

    net = _net(varied, head_type)
    embed = varied.model.get_input_embeddings()
    ids = _ids()
    n = ids.shape[1] - 1
    hidden = _hidden(varied, ids)
    feats = net.features({0: hidden[..., :64], 1: hidden[..., 64:]})[:, :n]
    ones = torch.ones_like(ids)
    steps = net.parallel
    rows = list(block_rows(net, feats, ids, ones, ones, embed, steps, num_anchors=None))
    for t in (0, 9, n - steps - 1):
        drafter = DSparkDrafter(net, varied, chain(steps))
        drafter.propose(ids[:, : t + 2], hidden[:, : t + 1])
        out = drafter._slots(steps)
        base = net.logits(out, drafter.lm_head).float()
        state = None
        for j, step in enumerate(rows):
            at = ((step.batch == 0) & (step.position == t)).nonzero()[0, 0]
            bi, ti, col = step.batch[at : at + 1], step.position[at : at + 1], step.column[at : at + 1]
            bias, emb = slot_bias(net, ids, step.out, bi, ti, col, j)
            h = step.out[bi, col]
            ref = net.logits(h, drafter.lm_head).float() + bias.float()
            ours, conf, state = drafter._children(out[j : j + 1], base[j], ids[0, t + j + 1 : t + j + 2], state)
            tol = 1e-3 * float(ref.abs().max())
            assert torch.allclose(ours, ref, atol=tol), (t, j)
            ref_conf = torch.sigmoid(net.confidence_logit(h, emb).float())
            assert torch.allclose(conf, ref_conf, atol=1e-4), (t, j)


@torch.no_grad()
def test_each_draft_conditions_on_the_token_drafted_before_it(varied, one_thread):
    """A chain round drafts depth d as argmax(base_d + W2 W1[depth d-1's draft]); the same backbone without the
    Markov bias (DFlash's drafter on the same weights) drafts another chain (negative control)."""
    from eval.drafters.dflash import DFlashDrafter
    from eval.drafters.dspark import DSparkDrafter
    from eval.engine.tree import chain

    net = _net(varied)
    ids = _ids(24)
    hidden = _hidden(varied, ids)
    drafter = DSparkDrafter(net, varied, chain(net.parallel))
    tokens = drafter.propose(ids, hidden[:, :-1]).tokens[0]
    base = net.logits(drafter._slots(net.parallel), drafter.lm_head).float()
    w = net.markov_head
    for d in range(1, net.parallel + 1):
        expected = (base[d - 1] + w.markov_w2(w.markov_w1(tokens[d - 1]))).argmax()
        assert int(tokens[d]) == int(expected), d
    plain = DFlashDrafter(net, varied, chain(net.parallel)).propose(ids, hidden[:, :-1]).tokens[0]
    assert not torch.equal(plain[1:], tokens[1:]), "the Markov bias changed no draft: the check would prove nothing"


def _set_confidence(net: DSparkNet, p: float) -> None:
    with torch.no_grad():
        net.confidence_head.proj.weight.zero_()
        net.confidence_head.proj.bias.fill_(math.log(p / (1 - p)))


@pytest.mark.parametrize("threshold,depth", [(0.0, 4), (0.2, 3), (0.3, 2), (0.5, 1), (0.7, 0)])
@torch.no_grad()
def test_the_confidence_cuts_the_proposal_where_survival_falls_below_the_threshold(varied, threshold, depth,
                                                                                    one_thread):
    """Every slot predicted to pass with 0.6: survival 0.6, 0.36, 0.216, 0.13; the round keeps the depths whose
    survival is >= the threshold, a tree cut at that depth with the tokens of its kept nodes, and runs the Markov
    bias only for the depths it keeps."""
    from eval.drafters.dspark import DSparkDrafter
    from eval.engine.tree import from_medusa_choices

    net = _net(varied)
    _set_confidence(net, 0.6)
    ids = _ids(24)
    hidden = _hidden(varied, ids)
    tree = from_medusa_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)])
    full = DSparkDrafter(net, varied, tree).propose(ids, hidden[:, :-1])
    drafter = DSparkDrafter(net, varied, tree, threshold=threshold)
    biased = []  # the depths whose Markov bias ran: a depth the cut drops is never drafted
    bias_logits = drafter._bias_logits
    drafter._bias_logits = lambda *a: biased.append(1) or bias_logits(*a)  # type: ignore[method-assign]
    draft = drafter.propose(ids, hidden[:, :-1])
    assert len(biased) == depth
    assert draft.tree.max_depth == depth and drafter.cut_depths == [depth]
    assert drafter.last_confidence == pytest.approx([0.6] * min(depth + 1, 4))  # drafting stopped at the cut
    keep = [i for i, d in enumerate(tree.depths) if d <= depth]
    assert draft.tokens[0].tolist() == full.tokens[0, keep].tolist()


@pytest.mark.parametrize("head_type,tree,threshold", [("vanilla", "chain", 0.0), ("vanilla", "tree", 0.4),
                                                      ("gated", "tree", 0.0), ("rnn", "chain", 0.4)])
def test_greedy_output_is_plain_greedy(varied, head_type, tree, threshold, one_thread):
    """Whatever DSpark proposes and wherever the confidence cuts it, greedy speculative decoding emits plain greedy's
    tokens."""
    from eval.drafters.dspark import DSparkDrafter
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.tree import chain, from_medusa_choices

    net = _net(varied, head_type)
    _set_confidence(net, 0.7)
    shape = chain(4) if tree == "chain" else from_medusa_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    drafter = DSparkDrafter(net, varied, shape, threshold=threshold)
    ids = torch.tensor([varied.tokenizer("The quick brown fox jumps over the lazy dog. The")["input_ids"]])
    plain = greedy_decode(varied, ids, 24, [])
    spec = speculative_decode(varied, drafter, ids, 24, [])
    assert torch.equal(spec.tokens, plain.tokens)
    assert len(drafter.cut_depths) == spec.num_forwards - 1 or threshold == 0.0


def test_the_confidence_head_learns_each_slots_acceptance(varied, one_thread):
    """Trained as the recipe trains it (BCE against the detached 1 - TV), the head's mean prediction per slot comes
    within 0.03 of the measured acceptance; with confidence_weight=0 (the negative control) it stays where it began,
    far from it. Fixed seed."""
    from train.dspark import DSparkModule

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(20, 1000, (2, 16), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}

    def gap(weight: float) -> float:
        torch.manual_seed(0)
        module = DSparkModule(varied, optimizer=partial(torch.optim.AdamW, lr=0.1), mask_token_id=16, block_size=4,
                              aux_layer_ids=[0, 1], markov_rank=8, num_anchors=6, confidence_weight=weight)
        module.net.requires_grad_(False)  # the backbone and the Markov head stay: the head learns what they accept
        head = module.net.confidence_head.requires_grad_(True)
        with torch.no_grad():
            head.proj.bias.fill_(-3.0)  # starts predicting 0.05
        opt = torch.optim.LBFGS(head.parameters(), lr=1, max_iter=6, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = module._loss(module.model_step(batch, module.net.parallel, train=True)["losses"])
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            module.model_step(batch, module.net.parallel, train=False)
        c = module._calib
        rows = c["rows"].clamp(min=1)
        return float(((c["pred"] - c["accept"]) / rows).abs().max())

    assert gap(1.0) < 0.03
    assert gap(0.0) > 0.5


def test_the_export_is_what_vllms_dspark_reads(varied, tmp_path):
    """config.json in the speculators `dspark` type (markov_rank, markov_head_type, the confidence head's flags, the
    anchor as the bonus token) and the tensors named as vLLM's qwen3_dspark loads them; read back, the same net."""
    from safetensors.torch import load_file

    from models.exports.io import load_export, save_export

    net = _net(varied)
    export = save_export(net, varied, tmp_path / "export", {"eagle_topk_accuracy": [[0.5, 0.6]] * net.parallel})
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    assert (config["markov_rank"], config["markov_head_type"]) == (16, "vanilla")
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["sample_from_anchor"] is False and config["block_size"] == 5
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    names = set(load_file(export / "model.safetensors"))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight"} <= names
    loaded = load_export(export, varied).net
    assert type(loaded) is DSparkNet
    for (k, a), (_, b) in zip(net.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k


def test_tree_auto_plans_on_the_confidence_table(varied):
    """tree=auto builds the tree from the export's dspark_confidence_table (the head's predicted acceptance per
    depth), not from eagle_topk_accuracy, when both are there."""
    from eval.drafters.dspark import dspark_drafter
    from eval.engine.tree import AutoTree, auto_tree

    net = _net(varied)
    deep = [[0.9, 0.95, 0.97]] * net.parallel  # the head: every depth likely -> a deep chain-like tree
    wide = [[0.2, 0.5, 0.7]] + [[0.05, 0.1, 0.12]] * (net.parallel - 1)  # top-k: shallow and wide
    drafter = dspark_drafter(net, {"dspark_confidence_table": deep, "eagle_topk_accuracy": wide}, varied,
                             AutoTree(size=6))
    assert drafter.tree == auto_tree(deep, 6) != auto_tree(wide, 6)


def test_bad_input_is_refused_with_one_message_each(varied, tmp_path):
    """A Markov rank the vocabulary cannot hold as a low-rank bias, a block the window cannot hold, a DSpark export
    without its confidence head, a threshold outside [0, 1]: each one message naming the value and the fix."""
    from safetensors.torch import load_file, save_file

    from eval.drafters.dspark import check_threshold
    from models.exports.io import load_export, save_export

    for rank in (0, varied.vocab_size, 2.5):
        with pytest.raises(UserError, match=rf"markov_rank={rank!r}: .* 1 <= r < the vocabulary \({varied.vocab_size}"):
            build_dspark(varied, 16, 5, 1, [0, 1], markov_rank=rank)
    window = varied.config.max_position_embeddings
    with pytest.raises(UserError, match=rf"block_size={window}: the verifier's window \({window} positions\) "
                                        rf"cannot hold .* use a block_size below {window}"):
        build_dspark(varied, 16, window, 1, [0, 1], markov_rank=8)
    with pytest.raises(UserError, match="markov_head_type='lstm': choose one of"):
        build_dspark(varied, 16, 5, 1, [0, 1], markov_rank=8, markov_head_type="lstm")
    with pytest.raises(UserError, match=r"confidence_threshold=1.5: .* \[0, 1\]"):
        check_threshold(1.5)
    export = save_export(_net(varied), varied, tmp_path / "export")
    tensors = load_file(export / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("confidence_head.")}, export / "model.safetensors")
    with pytest.raises(UserError, match=r"a DSpark export without its confidence head .* missing "
                                        r"\['confidence_head.proj.weight', 'confidence_head.proj.bias'\].*"
                                        r"python train.py model=dspark"):
        load_export(export, varied)
    save_file(tensors, export / "model.safetensors")
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps(config | {"enable_confidence_head": False}))
    with pytest.raises(UserError, match="enable_confidence_head=false: a DSpark export without its confidence head"):
        load_export(export, varied)


def test_dpace_weighs_the_token_loss_and_the_confidence_bce_keeps_the_fixed_decay(varied, one_thread):
    """model.slot_weighting=dpace (DFlashModule's hook) reweighs the token loss per block; the confidence BCE's share
    of the training loss stays sum_k step_decay^(k-1) BCE_k, as under exp (speculators keeps it on the fixed decay),
    while the token loss's share differs between the two weightings."""
    from train.dspark import DSparkModule

    ids = torch.randint(20, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}

    torch.manual_seed(0)
    module = DSparkModule(varied, optimizer=partial(torch.optim.AdamW, lr=0.1), mask_token_id=16, block_size=4,
                          aux_layer_ids=[0, 1], markov_rank=8, num_anchors=6)

    def loss(weighting: str, weight: float) -> float:
        module.hparams.update(slot_weighting=weighting, confidence_weight=weight)
        torch.manual_seed(0)  # the same anchors
        with torch.no_grad():
            return float(module._loss(module.model_step(batch, module.net.parallel, train=True)["losses"]))

    bce = {w: loss(w, 1.0) - loss(w, 0.0) for w in ("exp", "dpace")}
    assert bce["exp"] > 0 and bce["dpace"] == pytest.approx(bce["exp"], rel=1e-4)
    assert loss("dpace", 0.0) != pytest.approx(loss("exp", 0.0), rel=1e-3)

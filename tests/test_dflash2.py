"""DFlash2 (models/dflash2.py, train/dflash2.py, eval/drafters/dflash2.py, models/formats/dflash2.py): a fresh one is
DFlash, the convolution stays inside a block and reads only earlier rows, training computes what decoding computes,
each draft conditions on the one before it, decoding is exact, the export is what vLLM's dflash2 reads, and bad
input is refused with a message."""

from __future__ import annotations

import pytest
import torch

from helpers import varied_llama
from models.dflash import block_rows, build_dflash
from models.dflash2 import DFlash2Net, build_dflash2, grouped_conv
from runtime.errors import UserError


@pytest.fixture(scope="module")
def varied():
    return varied_llama(seed=1)


def _net(verifier, block_size: int = 5, rank: int = 16) -> DFlash2Net:
    """A random DFlash2 drafter: every matrix (the convolutions' projections and the codebooks too) drawn, so the
    convolutions are not the identity and the selector re-ranks."""
    torch.manual_seed(0)
    net = build_dflash2(verifier, mask_token_id=16, block_size=block_size, num_layers=2, aux_layer_ids=[0, 1],
                        selector_rank=rank, selector_top_k=8)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 if "codebook" in name else 0.2))
            elif "base_kernel" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return net.float().eval()


def _hidden(verifier, ids):
    states = verifier.model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in (0, 1)], dim=-1)


@torch.no_grad()
def test_a_fresh_dflash2_is_dflash(varied):
    """The convolutions start as the identity: DFlash's weights in a fresh DFlash2 give DFlash's block outputs."""
    torch.manual_seed(0)
    dflash = build_dflash(varied, 16, block_size=4, num_layers=2, aux_layer_ids=[0, 1]).eval()
    fresh = build_dflash2(varied, 16, block_size=4, num_layers=2, aux_layer_ids=[0, 1], selector_rank=8).eval()
    missing, _ = fresh.load_state_dict(dflash.state_dict(), strict=False)
    assert missing and all(("conv" in k) or k.startswith("candidate_selector") for k in missing)
    ctx = torch.randn(1, 6, 64)
    pos = torch.arange(6)[None]
    kv = dflash.context_kv(ctx, pos)
    emb = torch.randn(1, 8, 64)
    mask = torch.ones(1, 1, 8, 14, dtype=torch.bool)
    block_pos = torch.arange(6, 14)[None]
    torch.testing.assert_close(fresh.block(emb, block_pos, mask, *kv), dflash.block(emb, block_pos, mask, *kv))


def test_the_convolution_reads_earlier_rows_of_its_own_block_only():
    """Row k of a block mixes rows k, k-1 (two taps); a change at row 5 of blocks of 4 (row 1 of the second block)
    moves rows 5 and 6, never row 4 (its block's first) nor the first block."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 32, generator=gen)
    delta = torch.randn(1, 8, 2, 2, generator=gen)
    base = torch.randn(2, 32, generator=gen)
    y = x.clone()
    y[0, 5] += 1.0
    moved = (grouped_conv(y, delta, base, 4, 16) - grouped_conv(x, delta, base, 4, 16)).abs().amax(-1)[0]
    assert (moved[[5, 6]] > 0).all() and (moved[[0, 1, 2, 3, 4, 7]] == 0).all()
    z = x.clone()
    z[0, 3] += 1.0  # the first block's last row: the second block's first row must not read it
    moved = (grouped_conv(z, delta, base, 4, 16) - grouped_conv(x, delta, base, 4, 16)).abs().amax(-1)[0]
    assert moved[3] > 0 and (moved[4:] == 0).all()


@torch.no_grad()
def test_training_blocks_are_what_decoding_computes(varied):
    """Slot k of the block whose context ends at t (training: block_rows, every anchor, convolutions across all the
    anchors' rows) = the drafter's slot k after a prefill of positions 0..t with root x_{t+1}; and the chain's
    depth-k logits are the selector's re-scoring given the depth before's argmax."""
    from eval.drafters.dflash2 import DFlash2Drafter
    from eval.engine.tree import chain

    net = _net(varied)
    embed = varied.model.get_input_embeddings()
    ids = torch.randint(20, 1000, (1, 30), generator=torch.Generator().manual_seed(3))
    n = ids.shape[1] - 1
    hidden = _hidden(varied, ids)
    feats = net.features({0: hidden[..., :64], 1: hidden[..., 64:]})[:, :n]
    ones = torch.ones_like(ids)
    steps = net.parallel
    rows = list(block_rows(net, feats, ids, ones, ones, embed, steps, num_anchors=None))
    for t in (0, 9, n - steps - 1):
        drafter = DFlash2Drafter(net, varied, chain(steps))
        drafter.propose(ids[:, : t + 2], hidden[:, : t + 1])
        out = drafter._slots(steps)  # (K, D)
        for j, step in enumerate(rows):
            at = ((step.batch == 0) & (step.position == t)).nonzero()[0, 0]
            torch.testing.assert_close(out[j], step.out[0, step.column[at]], atol=1e-4, rtol=1e-4)
        logits = drafter._depth_logits(None)  # (K, V)
        unary = net.logits(out, drafter.lm_head).float()
        prev = ids[0, t + 1 : t + 2]
        for j in range(steps):
            ref = net.rescored(unary[j : j + 1], out[j : j + 1], prev)[0]
            torch.testing.assert_close(logits[j], ref)
            assert torch.isfinite(ref).sum() == net.selector_top_k  # K candidates, every other token impossible
            prev = ref.argmax()[None]


@torch.no_grad()
def test_each_draft_conditions_on_the_one_before(varied):
    """In a tree, the children of two depth-1 nodes are re-scored given their own parent's token: they differ, and
    each is what the selector gives for that parent."""
    from eval.drafters.dflash2 import DFlash2Drafter
    from eval.engine.tree import from_medusa_choices

    net = _net(varied)
    tree = from_medusa_choices([[0], [1], [0, 0], [1, 0], [0, 1], [1, 1]])
    drafter = DFlash2Drafter(net, varied, tree)
    ids = torch.randint(20, 1000, (1, 14), generator=torch.Generator().manual_seed(5))
    draft = drafter.propose(ids, _hidden(varied, ids)[:, :-1])
    out = drafter._slots(2)
    unary = net.logits(out, drafter.lm_head).float()
    tokens = draft.tokens[0]
    first = net.rescored(unary[0:1], out[0:1], ids[0, -1:])[0].topk(2).indices
    assert tokens[[tree.ranks.index(0, 1), tree.ranks.index(1, 1)]].tolist() == first.tolist()
    for node in range(1, tree.num_nodes):
        if tree.depths[node] == 2:
            parent = tree.parents[node]
            want = net.rescored(unary[1:2], out[1:2], tokens[parent : parent + 1])[0].topk(2).indices
            assert tokens[node] == want[tree.ranks[node]], node
    kids = {tree.parents[i]: tokens[i].item() for i in range(1, tree.num_nodes)
            if tree.depths[i] == 2 and tree.ranks[i] == 0}
    assert len(set(kids.values())) == 2  # two parents, two different best children


@pytest.mark.parametrize("shape", ["chain", "tree"])
@torch.no_grad()
def test_greedy_decoding_is_exact(varied, shape):
    from eval.drafters.build import make_drafter
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.tree import Chain, from_medusa_choices

    tree = Chain(4) if shape == "chain" else from_medusa_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
    drafter = make_drafter("dflash2", varied, tree, net=_net(varied))
    for prompt in ("The capital of France is", "def add(a, b):"):
        ids = varied.tokenizer(prompt, return_tensors="pt").input_ids
        want = greedy_decode(varied, ids, 24).tokens[0].tolist()
        assert speculative_decode(varied, drafter, ids, 24).tokens[0].tolist() == want, prompt


def test_selector_labels_put_the_target_among_the_k():
    from train.dflash2 import selector_labels

    cand = torch.tensor([[5, 7, 9, 11], [5, 7, 9, 11]])
    train, label, inside = selector_labels(cand, torch.tensor([9, 42]))
    assert train.tolist() == [[5, 7, 9, 11], [5, 7, 9, 42]]
    assert label.tolist() == [2, 3] and inside.tolist() == [True, False]


def test_the_selector_loss_reaches_the_codebooks_teacher_forced(varied):
    """One training step's loss: the K-way selector loss sends gradient to the previous tokens' predecessor rows (the
    true tokens x_{t+k}, teacher-forced) and to the candidates' successor rows only; with selector_weight=0 the
    selector gets none, and the unary head's gradient is there either way."""
    import functools

    from train.dflash2 import DFlash2Module

    ids = torch.randint(20, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    grads = {}
    for weight in (1.0, 0.0):
        torch.manual_seed(0)
        module = DFlash2Module(varied, functools.partial(torch.optim.AdamW), block_size=3, aux_layer_ids=[0, 1],
                               num_anchors=None, selector_rank=16, selector_top_k=8, selector_weight=weight)
        res = module.model_step(batch, module.net.parallel, train=True)
        module._loss(res["losses"]).backward()
        grads[weight] = {n: p.grad for n, p in module.named_parameters()}
    sel = grads[1.0]
    rows = sel["net.candidate_selector.predecessor_codebook"].abs().sum(-1).nonzero()[:, 0]
    assert set(rows.tolist()) <= set(ids[:, 1:].flatten().tolist()) and rows.numel() > 3
    assert sel["net.candidate_selector.hidden_projection.weight"].abs().sum() > 0
    assert 0 < (sel["net.candidate_selector.successor_codebook"].abs().sum(-1) > 0).sum() < 400
    off = grads[0.0]
    assert all(off[n] is None or off[n].abs().sum() == 0 for n in off if "candidate_selector" in n)
    assert off["net.fc.weight"].abs().sum() > 0 and sel["net.layers.0.mlp_conv.kernel_projection.weight"] is not None


def test_the_export_is_what_vllms_dflash2_reads(varied, tmp_path):
    """speculators' dflash2 type: architecture DFlash2DraftModel, the four keys at the top level (vLLM's
    update_dflash2 reads them there), vLLM's tensor names; read back as the same network."""
    import json

    from safetensors import safe_open

    from models.exports.io import load_export, save_export

    net = _net(varied)
    path = save_export(net, varied, tmp_path / "export", {"eagle_topk_accuracy": [[0.5, 0.6]] * net.parallel})
    config = json.loads((path / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == \
        {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
    assert config["block_size"] == 5 and config["sample_from_anchor"] is False
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "fc.weight"} <= names
    loaded = load_export(path, varied)
    assert type(loaded.net) is DFlash2Net and loaded.kind == "dflash2"
    for k, v in net.state_dict().items():
        assert torch.equal(loaded.net.state_dict()[k], v), k
    config.pop("selector_rank")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="needs selector_rank.*load it as dflash"):
        load_export(path, varied)


def test_bad_input_is_refused_with_a_message(varied):
    from eval.drafters.dflash2 import DFlash2Drafter, dflash2_drafter
    from eval.engine.tree import Chain, from_medusa_choices

    def build(**kw):
        return build_dflash2(varied, 16, block_size=4, aux_layer_ids=[0, 1], **kw)

    with pytest.raises(UserError, match=r"conv_group_size=24.*divide the hidden size \(64\)"):
        build(conv_group_size=24)
    with pytest.raises(UserError, match=r"conv_kernel_size=5.*block size \(4\)"):
        build(conv_kernel_size=5)
    with pytest.raises(UserError, match=r"selector_rank=49152.*1 <= r < the vocabulary"):
        build(selector_rank=49152)
    with pytest.raises(UserError, match="selector_top_k=1"):
        build(selector_top_k=1)
    net = _net(varied)
    with pytest.raises(UserError, match=r"re-scores its top 8 candidates.*ranks below 8"):
        DFlash2Drafter(net, varied, from_medusa_choices([[i] for i in range(9)]))
    with pytest.raises(UserError, match="draft_vocab=null for a DFlash2 export"):
        dflash2_drafter(net, {}, varied, Chain(2), head_ids=torch.arange(10))


@pytest.mark.parametrize("control", [False, True])
def test_sampled_rounds_follow_the_verifier(control, monkeypatch):
    """tests/test_sampling.py's statistical check on a random DFlash2 tree (top_p 0.9, top_k 6, temperature 1):
    speculative rounds' first tokens are distributed as the verifier's own samples (chi-squared p > 0.01); the
    negative control, every draft accepted, must fail (p < 1e-6)."""
    import test_sampling as ts

    from eval.engine.acceptance import sampled as sampling

    verifier = varied_llama()
    if control:
        original = sampling.rejection_plan

        def accept_all(*args):
            plan = original(*args)
            return sampling.RejectionPlan(torch.ones_like(plan.accept_prob), plan.final, plan.children)

        monkeypatch.setattr(sampling, "rejection_plan", accept_all)
    setting = "t1-top_k4" if control else "t1-top_p0.9-top_k6"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec, direct = ts._speculative_pairs(verifier, "dflash2-tree-sampled", ts.REAL[setting], seed=11)
    finally:
        torch.set_num_threads(before)
    p = ts._chi2_p(spec, direct)
    assert (p < 1e-6) if control else (p > 0.01), p


@torch.no_grad()
def test_the_planner_times_the_block_and_the_selector_the_budget_buys(varied, monkeypatch):
    """eval.planner.cost.draft_curve times `trial(s)`: one block over the depth of the tree tree.size=auto builds for s
    drafts from the export's table, and the selector once per depth of it."""
    from eval.drafters.dflash2 import DFlash2Drafter
    from eval.engine.tree import auto_tree

    net = _net(varied, block_size=6)
    table = [[0.6, 0.7, 0.75], [0.5, 0.6, 0.65], [0.45, 0.55, 0.6], [0.4, 0.5, 0.55], [0.3, 0.4, 0.45]]
    drafter = DFlash2Drafter(net, varied, auto_tree(table, 20), table=table)
    ids = torch.randint(20, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    hidden = _hidden(varied, ids)
    drafter.propose(ids, hidden[:, :-1])
    drafter.accepted(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    blocks, selector = [], []
    block, rescored = net.block, net.rescored
    monkeypatch.setattr(net, "block", lambda *a, **k: blocks.append(a[0].shape[1]) or block(*a, **k))
    monkeypatch.setattr(net, "rescored", lambda *a, **k: selector.append(1) or rescored(*a, **k))
    seq = torch.cat([ids, ids[:, -1:]], dim=1)
    for drafts in (1, 12):
        blocks.clear(), selector.clear()
        tree = drafter.trial(seq, hidden[:, -1:], drafts)
        assert tree == auto_tree(table, drafts)
        assert blocks == [1 + tree.max_depth] and len(selector) == tree.max_depth

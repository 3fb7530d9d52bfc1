"""EAGLE drafting at decode time: exact greedy output with random EAGLE-1 / EAGLE-3 drafters (chain and dynamic
tree), drafts that match the training-time unroll (train/eagle.py) on the same tokens, acceptance with the drafter's
cache carried over rounds, and the export round trip, all on the tiny verifier in fp32.

As in test_decode.py, the tiny verifier gets large random layer weights so that its continuation depends on the whole
context; the acceptance test instead uses the plain tiny verifier, which repeats its token, with "identity" drafters
whose output is their input feature (so they predict the root again at every depth, which is right there).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from eval.drafters.build import Drafter, make_drafter
from eval.drafters.eagle import EagleDrafter
from eval.engine import hf_forward as kv
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import Chain, DynamicTree
from helpers import varied_llama
from models.eagle import EagleNet, build_eagle, unroll_mask
from models.exports.io import save_export
from models.verifiers.core import Verifier
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError

PROMPTS = ["Hello, my name is", "def fib(n):\n    return", "The capital of France is Paris. The capital of"]
MAX_NEW = 40
KINDS = ["eagle", "eagle3"]
TREES = {"chain": Chain(4), "dynamic": DynamicTree()}  # the default dynamic tree: depth 5, 24 nodes, topk 16
TOL = 1e-3  # on log-probabilities: fp32 noise is ~1e-5, an off-by-one alignment moves them by > 0.1


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base() -> Verifier:
    return build_tiny(cache_dir=os.environ.get("SPECDRAFT_CACHE"), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def varied() -> Verifier:
    return varied_llama()


def random_net(kind: str, verifier: Verifier, seed: int = 0) -> EagleNet:
    """A drafter with random weights (EAGLE-3: a random 4096-token draft vocabulary), scaled so that its logits
    spread over tens of nats (larger ones underflow exp into denormals, which are slow on a CPU). `eagle3.1`: EAGLE-3
    with EAGLE-3.1's fc_norm (random norm weights) and norm_output."""
    v31 = kind == "eagle3.1"
    kind = "eagle3" if v31 else kind
    net = build_eagle(kind, verifier, draft_vocab_size=4096 if kind == "eagle3" else None,
                      aux_layer_ids=[0, 1] if kind == "eagle3" else None, fc_norm=v31, norm_output=v31)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for norm in net.fc_norm or [] if v31 else []:
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) * 2)
        if kind == "eagle3":
            net.set_draft_vocab(torch.randperm(verifier.vocab_size, generator=gen)[:4096])
    return net


def identity_net(kind: str, verifier: Verifier, vocab: list[int]) -> EagleNet:
    """A drafter whose output is its input feature F_t, so it drafts M_q's token after position t at every depth,
    with logits scaled up 1000x so that it is confident (the tiny verifier's own distribution is nearly flat).
    EAGLE-3 reads the final normed layer and drafts over `vocab` (padded with other ids) through M_q's head rows."""
    last = verifier.num_layers  # hidden_states[L]: after the final norm
    net = build_eagle(kind, verifier, draft_vocab_size=256 if kind == "eagle3" else None,
                      aux_layer_ids=[last - 1] if kind == "eagle3" else None)
    # test-only: HF's normed hidden_states[L], which no engine can feed (so build_eagle refuses it)
    if kind == "eagle3":
        net.aux_layer_ids = [last]
    d = verifier.hidden_size
    with torch.no_grad():
        net.layer.self_attn.o_proj.weight.zero_()
        net.layer.mlp.down_proj.weight.zero_()
        net.fc.weight.copy_(torch.cat([torch.zeros(d, d), 1000 * torch.eye(d)], 1) if kind == "eagle" else torch.eye(d))
        if kind == "eagle3":
            ids = list(dict.fromkeys(vocab + [i for i in range(1000, 2000) if i not in vocab]))[:256]
            net.set_draft_vocab(torch.tensor(ids))
            net.lm_head.weight.copy_(1000 * verifier.lm_head.weight[net.draft_to_target(torch.arange(256))])
    return net


def hf_greedy(verifier: Verifier, ids: torch.Tensor, max_new: int) -> list[int]:
    eos = verifier.tokenizer.eos_token_id
    out = verifier.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                  do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(varied):
    refs = []
    for prompt in PROMPTS:
        ids = varied.tokenizer(prompt, return_tensors="pt").input_ids
        refs.append((ids, hf_greedy(varied, ids, MAX_NEW)))
    assert greedy_decode(varied, refs[0][0], MAX_NEW).tokens[0].tolist() == refs[0][1]
    return refs


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("kind", KINDS)
def test_random_eagle_drafts_give_exact_greedy_output(varied, references, kind, tree_name):
    drafter = make_drafter(kind, varied, TREES[tree_name], net=random_net(kind, varied))
    assert isinstance(drafter, Drafter)
    for ids, ref in references:
        result = speculative_decode(varied, drafter, ids, MAX_NEW)
        assert result.tokens[0].tolist() == ref
        assert result.num_forwards == 1 + len(result.accept_lengths)


def unrolled_logp(net: EagleNet, verifier: Verifier, ids: torch.Tensor, t: int, steps: int,
                  shift: int = 0) -> torch.Tensor:
    """The training-time unroll (models.eagle.unroll, written out) over `ids` (1, L): draft log-probabilities at
    position t for steps 0..steps-1, i.e. for x_{t+2} .. x_{t+steps+1}. `shift` pairs x_{t+1} with F_{t-shift} (a
    negative control). Returns (steps, V_draft)."""
    hs = verifier.model(ids, output_hidden_states=True).hidden_states
    n = ids.shape[1] - 1
    feats = F.pad(net.features(hs), (0, 0, shift, 0))[:, :n]  # (1, n, D): F_{t-shift} at position t
    hidden, past_k, past_v, probs = feats, None, None, []
    positions = torch.arange(n)[None]
    for j in range(steps):
        tok = F.pad(ids[:, 1 + j :], (0, j), value=0)[:, :n]  # (1, n): x_{t+j+1}
        mask = unroll_mask(torch.ones(1, n, dtype=torch.bool), j)
        out, k, v = net.step(hidden, verifier.model.get_input_embeddings()(tok), positions + j, mask, past_k, past_v)
        past_k = k if past_k is None else torch.cat([past_k, k], dim=2)
        past_v = v if past_v is None else torch.cat([past_v, v], dim=2)
        probs.append(net.logits(out[:, t], verifier.lm_head)[0].log_softmax(-1))
        hidden = net.carry(out)  # EAGLE-3.1 norm_output: the final-normed output
    return torch.stack(probs)


def check_nodes(net: EagleNet, verifier: Verifier, seq: torch.Tensor, draft, t: int) -> None:
    """Every node of a drafted tree is its parent's rank-th child under the training unroll along its own path (the
    tree mask is the unroll's mask), at position t, the token before the root."""
    tree = draft.tree
    for node in range(1, tree.num_nodes):
        path, i = [], node
        while i > 0:
            path.append(i)
            i = tree.parents[i]
        path = path[::-1]
        ext = torch.cat([seq, draft.tokens[:, path]], dim=1)
        logp = unrolled_logp(net, verifier, ext, t, len(path))[-1]  # (V_draft,) the parent's children
        token = draft.tokens[0, node] if net.kind == "eagle" else net.t2d[: draft.tokens[0, node]].sum()
        assert abs(logp[token] - logp.topk(tree.ranks[node] + 1).values[-1]) < TOL, (node, tree.ranks[node])


@pytest.mark.parametrize("kind", [*KINDS, "eagle3.1"])
@torch.no_grad()
def test_drafts_match_the_training_unroll_across_rounds(varied, kind):
    net = random_net(kind, varied, seed=3)
    # topk 3, depth 3: 3 + 9 + 9 candidates, all kept, so that the deepest nodes (under 3 parents, each with its own
    # ancestors, in one drafter forward) show whether the tree mask keeps the branches apart.
    drafter = EagleDrafter(net, varied, DynamicTree(size=21, depth=3, topk=3))
    ids = varied.tokenizer(PROMPTS[2], return_tensors="pt").input_ids  # (1, T)
    # 1. Round one (after the prefill): every node follows the unroll at the position before the root.
    step = kv.forward(varied.model, kv.new_cache(), ids, hidden_layers=drafter.feature_layers)
    seq = torch.cat([ids, step.logits[:, -1:].argmax(-1)], dim=1)  # (1, T+1): the root appended
    draft = drafter.propose(seq, step.hidden)
    tree = draft.tree
    assert tree.num_drafts == 21 and tree.max_depth == 3 and tree.depths.count(3) == 9
    assert drafter.cache_length == ids.shape[1]
    check_nodes(net, varied, seq, draft, ids.shape[1] - 1)
    best, node = [], 0  # the all-rank-0 path: the chain of top-1 drafts
    for _ in range(3):
        node = next(i for i in range(1, tree.num_nodes) if tree.parents[i] == node and tree.ranks[i] == 0)
        best.append(node)
    chain_ids = draft.tokens[0, best]
    ext = torch.cat([seq, chain_ids[None]], dim=1)
    ref = unrolled_logp(net, varied, ext, ids.shape[1] - 1, 3)
    assert chain_ids.tolist() == net.draft_to_target(ref.argmax(-1)).tolist()
    wrong = unrolled_logp(net, varied, ext, ids.shape[1] - 1, 3, shift=1)  # off by one: must differ
    assert chain_ids.tolist() != net.draft_to_target(wrong.argmax(-1)).tolist()

    # 2. Two drafts accepted, a new root: the drafter gets M_q's features at the 3 positions just committed.
    drafter.accepted(torch.tensor([2]), torch.tensor([[0, 1, 2]]))
    seq2 = torch.cat([ext[:, : seq.shape[1] + 2], torch.tensor([[1234]])], dim=1)
    full = kv.forward(varied.model, kv.new_cache(), seq2[:, :-1], hidden_layers=drafter.feature_layers)
    draft = drafter.propose(seq2, full.hidden[:, -3:])
    assert drafter.cache_length == seq2.shape[1] - 1
    assert draft.tree.num_drafts == 21 and draft.tree.max_depth == 3 and draft.tree.depths.count(3) == 9

    # 3. Every node of the new dynamic tree follows the unroll along its own path.
    check_nodes(net, varied, seq2, draft, seq2.shape[1] - 2)

    # 4. Out of step (a round skipped) is refused with a message, not a silent misalignment.
    with pytest.raises(UserError, match="out of step"):
        drafter.propose(seq2, full.hidden[:, -1:])


@pytest.mark.parametrize("kind", KINDS)
def test_good_drafts_are_accepted_and_the_cache_follows(base, kind):
    ids = base.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    ref = hf_greedy(base, ids, MAX_NEW)
    net = identity_net(kind, base, sorted(set(ref)))
    for tree in (Chain(4), DynamicTree(size=24, depth=5)):
        drafter = make_drafter(kind, base, tree, net=net)
        result = speculative_decode(base, drafter, ids, MAX_NEW)
        assert result.tokens[0].tolist() == ref
        # Every draft accepted: full rounds, then a last round cut to the tokens left of the 39 after the prefill's.
        full, left = divmod(MAX_NEW - 1, drafter.max_depth + 1)
        assert result.accept_lengths[:, 0].tolist() == [drafter.max_depth] * full + ([left - 1] if left else [])
        assert result.tau == pytest.approx((MAX_NEW - 1) / len(result.accept_lengths))
        # The drafter's cache covers every position M_q had committed when the last round was drafted.
        before_last = 1 + int((result.accept_lengths[:-1] + 1).sum())  # tokens emitted before the last round
        assert drafter.cache_length == ids.shape[1] + before_last - 1


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip_and_kind_mismatch(varied, tmp_path, kind):
    net = random_net(kind, varied, seed=5)
    path = save_export(net, varied, tmp_path / kind)
    loaded = make_drafter(kind, varied, DynamicTree(), checkpoint=path)
    fresh = make_drafter(kind, varied, DynamicTree(), net=net)
    ids = varied.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    a = speculative_decode(varied, loaded, ids, 12)
    b = speculative_decode(varied, fresh, ids, 12)
    assert a.tokens.tolist() == b.tokens.tolist() and a.accept_lengths.tolist() == b.accept_lengths.tolist()
    other = {"eagle": "eagle3", "eagle3": "eagle"}[kind]
    names = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3"}
    with pytest.raises(UserError, match=f"is an {names[kind]} export"):
        make_drafter(other, varied, DynamicTree(), checkpoint=path)
    with pytest.raises(UserError, match=f"given as {names[other]}"):
        make_drafter(other, varied, DynamicTree(), net=net)
    with pytest.raises(UserError, match="exactly one of"):
        make_drafter(kind, varied, DynamicTree())


@pytest.mark.parametrize("kind", KINDS)
def test_bounded_frontier_grows_the_same_dynamic_tree(varied, kind):
    """Expanding at most total - d frontier nodes at depth d (what propose does) keeps exactly the tree and tokens
    that expanding the topk best of every layer (EAGLE-2's rule) keeps, for budgets below, at and above topk. (A
    frontier of one node fails it; the bound's own tightness, a rare configuration with random nets, rests on the
    argument in EagleDrafter._expand.)"""
    saved = deepest = 0
    for seed, scale in enumerate([0.3, 0.3, 1.0, 2.0, 3.0, 4.0]):
        net = random_net(kind, varied, seed=seed)
        with torch.no_grad():  # flatter drafts (second-best branches win places) to peaked ones (deep chains)
            for p in net.parameters():
                p.mul_(scale)
        drafter = EagleDrafter(net, varied, DynamicTree(size=8, depth=4, topk=6))
        ids = varied.tokenizer(PROMPTS[seed % len(PROMPTS)], return_tensors="pt").input_ids
        step = kv.forward(varied.model, kv.new_cache(), ids, hidden_layers=drafter.feature_layers)
        seq = torch.cat([ids, step.logits[:, -1:].argmax(-1)], dim=1)
        root_out = drafter._extend(seq, step.hidden)
        for depth, topk, total in [(4, 6, 1), (4, 6, 2), (4, 6, 3), (4, 4, 4), (3, 4, 5), (5, 3, 7), (3, 6, 12),
                                   (5, 6, 10), (5, 8, 16)]:
            bounded = drafter._expand(root_out, depth, topk, total)
            rows = drafter.rows_fed
            full = drafter._expand(root_out, depth, topk, total, bound_frontier=False)
            assert bounded[0] == full[0] and torch.equal(bounded[1], full[1]), (seed, depth, topk, total)
            assert bounded[0].num_drafts == total and rows <= drafter.rows_fed
            saved += drafter.rows_fed - rows
            deepest = max(deepest, bounded[0].max_depth)
    assert deepest >= 4 and saved > 0  # deep trees were grown, and the bounds left rows out


@pytest.mark.parametrize("kind", KINDS)
def test_a_chain_drafts_what_the_tree_growth_drafts(varied, kind):
    """tree=chain (topk 1) takes `_chain`, which skips the tree's bookkeeping: its tokens and tree equal what the
    general growth (`_expand` without the frontier bound, every candidate list, ancestor matrix and rerank built)
    drafts from the same root, for chains shorter than, as long as and longer than the depth allows, flat to peaked
    nets (each call after another's drafted keys were left in the buffers past the cache, as rounds leave them)."""
    for seed, scale in enumerate([0.3, 1.0, 3.0]):
        net = random_net(kind, varied, seed=seed)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(scale)
        drafter = EagleDrafter(net, varied, Chain(4))
        ids = varied.tokenizer(PROMPTS[seed % len(PROMPTS)], return_tensors="pt").input_ids
        step = kv.forward(varied.model, kv.new_cache(), ids, hidden_layers=drafter.feature_layers)
        seq = torch.cat([ids, step.logits[:, -1:].argmax(-1)], dim=1)
        root_out = drafter._extend(seq, step.hidden)
        for depth, total in [(1, 1), (2, 2), (4, 4), (4, 2), (6, 6), (3, 5)]:
            fast = drafter._expand(root_out, depth, 1, total)
            rows = drafter.rows_fed
            general = drafter._expand(root_out, depth, 1, total, bound_frontier=False)
            assert fast[0] == general[0] and torch.equal(fast[1], general[1]), (seed, depth, total)
            assert fast[0].num_drafts == min(depth, total) == fast[0].max_depth and rows == min(depth, total)


@pytest.mark.parametrize("kind", KINDS)
def test_trial_drafts_like_propose_and_leaves_the_cache(varied, kind):
    """EagleDrafter.trial (what eval.planner.cost.draft_curve times) grows the tree the next propose grows with the same
    features, for any budget, and leaves the drafter's cache as it was, so that decoding continues after it."""
    net = random_net(kind, varied, seed=3)
    ids = varied.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    step = kv.forward(varied.model, kv.new_cache(), ids, hidden_layers=random_net(kind, varied).feature_layers)
    seq = torch.cat([ids, step.logits[:, -1:].argmax(-1)], dim=1)
    prefix, new = seq[:, :-1], step.hidden[:, -1:]  # the prefill stops one position short; a round brings the last
    for size in (1, 4, 9):
        drafter = EagleDrafter(net, varied, DynamicTree(size=size, depth=4, topk=3))
        drafter.propose(prefix, step.hidden[:, :-1])
        drafter.accepted(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
        keys = drafter._k.clone()
        trees = [drafter.trial(seq, new, size) for _ in range(2)]
        assert drafter.cache_length == ids.shape[1] - 1 and torch.equal(drafter._k, keys)
        assert trees[0] == trees[1] == drafter.propose(seq, new).tree and trees[0].num_drafts == size


SHIPPED_TABLE = [[0.447, 0.551, 0.614, 0.655], [0.511, 0.636, 0.678, 0.729], [0.522, 0.626, 0.698, 0.755],
                 [0.514, 0.666, 0.721, 0.792], [0.592, 0.702, 0.789, 0.831]]  # the first shipped EAGLE-3's, 4 ranks


@torch.no_grad()
def test_tree_auto_grows_and_prices_the_depth_its_table_buys(varied, monkeypatch):
    """Under tree=auto with the export's acceptance table, an EAGLE round grows no deeper than the tree that table
    buys for the budget (the tree tree.size=auto priced), however confident the drafter: a sharpened drafter grows a
    5-deep chain from 5 drafts without the table, 3 deep with it (auto_tree of this table). And `trial` (what
    eval.planner.cost.draft_curve times) feeds every depth of that tree at its widest whatever the scores: the same
    drafter rows on any prefix, and never fewer than a real round feeds."""
    from eval.engine.tree import AutoTree, auto_tree

    net = random_net("eagle3", varied, seed=3)
    original_logits = net.logits
    monkeypatch.setattr(net, "logits", lambda *a, **k: 60 * original_logits(*a, **k))  # confident: deep chains
    assert auto_tree(SHIPPED_TABLE, 5).max_depth == 3
    capped = EagleDrafter(net, varied, AutoTree(size=5), table=SHIPPED_TABLE)
    free = EagleDrafter(net, varied, AutoTree(size=5))
    calls: list[int] = []
    original_step = net.step
    monkeypatch.setattr(net, "step", lambda *a, **k: calls.append(a[0].shape[1]) or original_step(*a, **k))
    depths: dict[str, list[int]] = {"capped": [], "free": []}
    trials, rounds = [], []
    for prompt in PROMPTS:
        ids = varied.tokenizer(prompt, return_tensors="pt").input_ids
        step = kv.forward(varied.model, kv.new_cache(), ids, hidden_layers=net.feature_layers)
        seq = torch.cat([ids, step.logits[:, -1:].argmax(-1)], dim=1)
        for name, drafter in (("capped", capped), ("free", free)):
            drafter.propose(seq[:, :-1], step.hidden[:, :-1])
            drafter.accepted(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
            if name == "capped":
                calls.clear()
                drafter.trial(seq, step.hidden[:, -1:], 5)
                trials.append(list(calls))
            calls.clear()
            depths[name].append(drafter.propose(seq, step.hidden[:, -1:]).tree.max_depth)
            if name == "capped":
                rounds.append(list(calls))
    assert max(depths["free"]) == 5 and max(depths["capped"]) == 3, depths
    # the new position, then depths 1 and 2 fed min(topk, 5 - d) nodes each: on every prefix
    assert trials == [[1, 4, 3]] * len(PROMPTS), trials
    assert all(sum(r) <= sum(t) and len(r) <= len(t) for r, t in zip(rounds, trials)), (rounds, trials)


class _MaskedHead:
    """The verifier's full head with every token outside `ids` at -inf: what a head over those rows alone must draft."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor) -> None:
        self.weight, self.outside = weight, torch.ones(weight.shape[0], dtype=torch.bool).index_fill(0, ids, False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).masked_fill(self.outside, float("-inf"))


@torch.no_grad()
def test_draft_vocab_drafts_the_full_heads_best_within_the_subset(varied, references, tmp_path):
    net = random_net("eagle", varied, seed=7)
    counts = torch.rand(varied.vocab_size, generator=torch.Generator().manual_seed(0))
    path = save_export(net, varied, tmp_path / "eagle", target_counts=counts)
    tree = DynamicTree(size=12, depth=3, topk=4)
    small = make_drafter("eagle", varied, tree, checkpoint=path, draft_vocab=varied.vocab_size // 8)
    ids = counts.topk(varied.vocab_size // 8).indices  # the most frequent eighth
    assert torch.equal(small.head_ids, ids.sort().values)
    masked = EagleDrafter(net, varied, tree)
    masked.lm_head = _MaskedHead(varied.lm_head.weight, ids)
    full = EagleDrafter(net, varied, tree)
    seq_ids = varied.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    step = kv.forward(varied.model, kv.new_cache(), seq_ids, hidden_layers=small.feature_layers)
    seq = torch.cat([seq_ids, step.logits[:, -1:].argmax(-1)], dim=1)
    a, b, c = (d.propose(seq, step.hidden) for d in (small, masked, full))
    assert a.tree == b.tree and a.tokens.tolist() == b.tokens.tolist()  # the subset's best, in verifier ids
    assert set(a.tokens[0, 1:].tolist()) <= set(ids.tolist())
    assert not set(c.tokens[0, 1:].tolist()) <= set(ids.tolist())  # the full head would draft other tokens
    for prompt_ids, ref in references:  # exact whatever the head drafts over
        assert speculative_decode(varied, small, prompt_ids, MAX_NEW).tokens[0].tolist() == ref
    with pytest.raises(UserError, match="target_counts"):
        make_drafter("eagle", varied, tree, checkpoint=save_export(net, varied, tmp_path / "bare"), draft_vocab=64)
    with pytest.raises(UserError, match="draft_vocab=0"):
        make_drafter("eagle", varied, tree, checkpoint=path, draft_vocab=0)
    from safetensors.torch import save_file

    save_file({"counts": counts[:100].double()}, str(path / "specdraft" / "target_counts.safetensors"))  # another's
    with pytest.raises(UserError, match="another verifier"):
        make_drafter("eagle", varied, tree, checkpoint=path, draft_vocab=64)


@torch.no_grad()
def test_medusa_draft_vocab_takes_the_subsets_ranks(varied, references, tmp_path):
    from eval.engine.tree import auto_tree
    from models.medusa import MedusaHeads

    heads = MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=3)
    gen = torch.Generator().manual_seed(1)
    for p in heads.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    counts = torch.rand(varied.vocab_size, generator=gen)
    path = save_export(heads, varied, tmp_path / "medusa", target_counts=counts)
    tree = auto_tree([[0.5, 0.6, 0.7]] * 3, 8)  # ranks 0-2 at every depth
    small = make_drafter("medusa", varied, tree, checkpoint=path, draft_vocab=512)
    ids = counts.topk(512).indices.sort().values
    hidden = torch.randn(1, 1, varied.hidden_size, generator=gen)
    seq = torch.tensor([[1, 2, 3]])
    got = small.propose(seq, hidden).tokens[0, 1:]
    h = hidden[:, -1]
    logits = torch.stack([varied.lm_head(heads.head_features(h, k))[0] for k in range(3)])  # (K, V), full head
    sub = logits[:, ids].topk(3, dim=-1).indices  # each head's ranks within the subset
    want = [int(ids[sub[d - 1, r]]) for d, r in zip(tree.depths[1:], tree.ranks[1:])]
    assert got.tolist() == want
    assert got.tolist() != [int(logits[d - 1].topk(3).indices[r]) for d, r in zip(tree.depths[1:], tree.ranks[1:])]
    for prompt_ids, ref in references:
        assert speculative_decode(varied, small, prompt_ids, MAX_NEW).tokens[0].tolist() == ref


def test_eagle31_options_go_into_the_export_and_come_back(varied, tmp_path):
    """fc_norm and norm_output are written where engines read them (the top level for vLLM's eagle3, the layer config
    too) and read back into the same network: the loaded drafter drafts what the trained one drafts."""
    import json

    net = random_net("eagle3.1", varied, seed=5)
    path = save_export(net, varied, tmp_path / "e31")
    config = json.loads((path / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert config["transformer_layer_config"]["fc_norm"] is True and config["norm_before_residual"] is False
    loaded = make_drafter("eagle3", varied, DynamicTree(), checkpoint=path)
    assert loaded.net.norm_output and loaded.net.fc_norm is not None
    for a, b in zip(loaded.net.fc_norm, net.fc_norm):
        assert torch.equal(a.weight, b.weight)
    fresh = make_drafter("eagle3", varied, DynamicTree(), net=net)
    ids = varied.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    a, b = speculative_decode(varied, loaded, ids, 12), speculative_decode(varied, fresh, ids, 12)
    assert a.tokens.tolist() == b.tokens.tolist() and a.accept_lengths.tolist() == b.accept_lengths.tolist()
    feats = torch.randn(1, 3, 2 * varied.hidden_size)
    assert not torch.allclose(loaded.net.fuse(feats), loaded.net.fc(feats))  # fc_norm is applied
    config["norm_output"] = "yes"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="norm_output='yes': give true or false"):
        make_drafter("eagle3", varied, DynamicTree(), checkpoint=path)

"""Proof that sampled speculative decoding keeps the warped verifier distribution (eval.engine.sampling).

1. Exact: for one round on a small vocabulary, every draft outcome is enumerated (weighted by the probability the
   drafter draws it) and the rule's exact outcome law (`outcome_distribution` over `rejection_plan`, the same plan
   `sample_accept` walks) is summed; the first emitted token, and the first two, must follow warped q to 1e-6.
2. Statistical: real q and p from a tiny Llama verifier and random Medusa / EAGLE drafters, restricted by top-k to a
   small support; the rule `sample_accept` is run batched (20k rounds per setting, on the real tensors gathered per
   draft path, not 20k full decodes) against 20k direct draws from the verifier: chi-square on the first two tokens.
Each has a negative control (accept every draft; a residual without renormalisation) that must fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2_contingency

import eval.engine.acceptance.sampled as sampling
from eval.engine.acceptance.sampled import RejectionPlan, outcome_distribution, rejection_plan
from eval.engine.sampling import SamplingConfig, warp
from eval.engine.tree import from_medusa_choices
from runtime.errors import UserError

V = 6
TOL = 1e-6
SETTINGS = {"t1": (1.0, 1.0, 0), "t0.7": (0.7, 1.0, 0), "t1-top_p0.9": (1.0, 0.9, 0)}


def _probs(gen: torch.Generator, *shape: int, setting: tuple[float, float, int]) -> torch.Tensor:
    return warp(torch.randn(*shape, V, generator=gen, dtype=torch.float64) * 2, *setting).double()


class World:
    """A verifier q over paths of depth <= 2 and a drafter p (depth-1 p1, depth-2 p2 given the depth-1 token)."""

    def __init__(self, seed: int, setting: tuple[float, float, int]) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q0, self.q1, self.q2 = (_probs(gen, *s, setting=setting) for s in ((), (V,), (V, V)))
        self.p1, self.p2 = _probs(gen, setting=setting), _probs(gen, V, setting=setting)

    def q_at(self, path: tuple[int, ...]) -> torch.Tensor:
        return {0: lambda: self.q0, 1: lambda: self.q1[path[0]], 2: lambda: self.q2[path[0], path[1]]}[len(path)]()

    def target(self) -> torch.Tensor:
        """The verifier's law of the first two tokens. (V, V)"""
        return self.q0[:, None] * self.q1


def _paths(parents: tuple[int, ...], tokens: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for i, parent in enumerate(parents[1:], start=1):
        out.append(out[parent] + (tokens[i],))
    return out


def round_law(world: World, parents: tuple[int, ...], sampled: bool, topk: tuple[list[int], list[list[int]]] = None,
              same_p: bool = False) -> torch.Tensor:
    """Exact law of the first two emitted tokens after one round plus, where the round stops at the root, the next
    round's first token from q (V, V). Enumerates every draft: sampled (each node drawn from p1 / p2[parent]) or the
    one deterministic top-k draft."""
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    n = len(parents)
    if sampled:
        outcomes = list(itertools.product(range(V), repeat=n - 1))
    else:
        first, second = topk
        tok = [0] * (n - 1)
        for i in range(1, n):
            tok[i - 1] = first[i - 1] if depths[i] == 1 else second[i - 1]
        outcomes = [tuple(tok)]
    tokens = torch.tensor([[0, *o] for o in outcomes])  # (B, N); the root's token is not read
    weight = torch.ones(len(outcomes), dtype=torch.float64)
    q = torch.empty(len(outcomes), n, V, dtype=torch.float64)
    p = torch.zeros(len(outcomes), n, V, dtype=torch.float64)
    for b, o in enumerate(outcomes):
        paths = _paths(parents, [0, *o])
        for i in range(n):
            q[b, i] = world.q_at(paths[i])
            if i:
                drawn = world.p1 if depths[i] == 1 else world.p2[paths[parents[i]][0]]
                if same_p:
                    drawn = world.q_at(paths[parents[i]])
                p[b, i] = drawn
                if sampled:
                    weight[b] *= drawn[o[i - 1]]
    plan = rejection_plan(parents, tokens, q, p if sampled else None)
    _, stop = outcome_distribution(plan)  # (B, N, V)
    law = torch.zeros(V, V, dtype=torch.float64)
    for b, o in enumerate(outcomes):
        paths = _paths(parents, [0, *o])
        for i in range(n):
            if depths[i] == 0:  # stopped at the root: y1 from the residual, y2 from the next round (q)
                law += weight[b] * stop[b, 0][:, None] * world.q1
            elif depths[i] == 1:
                law[paths[i][0]] += weight[b] * stop[b, i]
            else:
                law[paths[i][0], paths[i][1]] += weight[b] * stop[b, i].sum()
    return law


CHAIN2 = (-1, 0, 1)
TREE = from_medusa_choices([[0], [1], [0, 0], [0, 1], [1, 0]]).parents  # 2 + 3 draft nodes


def _topk(world: World, parents: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
    """Deterministic top-k drafts: the r-th child of a node is the drafter's rank-r token at its parent."""
    order1 = world.p1.argsort(descending=True).tolist()
    rank, depth1, second = {}, {}, [None] * (len(parents) - 1)
    first = [None] * (len(parents) - 1)
    for i, parent in enumerate(parents[1:], start=1):
        rank[parent] = rank.get(parent, -1) + 1
        if parent == 0:
            first[i - 1] = depth1[i] = order1[rank[parent]]
        else:
            second[i - 1] = world.p2[depth1[parent]].argsort(descending=True).tolist()[rank[parent]]
    return first, second


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("case", ["chain-sampled", "tree-sampled", "chain-topk", "tree-topk", "chain-p=q"])
def test_exact_law_is_warped_q(setting, case):
    world = World(seed=len(case) + len(setting), setting=SETTINGS[setting])
    parents = CHAIN2 if case.startswith("chain") else TREE
    sampled = case != "chain-topk" and case != "tree-topk"
    law = round_law(world, parents, sampled, None if sampled else _topk(world, parents), same_p=case == "chain-p=q")
    assert not law.isnan().any()
    torch.testing.assert_close(law.sum(dim=1), world.q0, atol=TOL, rtol=0)  # the first token
    torch.testing.assert_close(law, world.target(), atol=TOL, rtol=0)  # the first two


@pytest.mark.parametrize("case", ["chain-sampled", "tree-sampled", "tree-topk"])
@pytest.mark.parametrize("control", ["accept_all", "no_renormalise"])
def test_exact_law_negative_controls_fail(monkeypatch, case, control):
    world = World(seed=3, setting=SETTINGS["t1"])
    parents = CHAIN2 if case.startswith("chain") else TREE
    sampled = case != "tree-topk"
    plan_fn = rejection_plan
    if control == "accept_all":
        def plan_fn(*args):  # noqa: F811
            plan = sampling.rejection_plan(*args)
            return RejectionPlan(torch.ones_like(plan.accept_prob), plan.final, plan.children)
    else:
        monkeypatch.setattr(sampling, "residual", lambda r, p: (r - p).clamp(min=0))
    monkeypatch.setitem(globals(), "rejection_plan", plan_fn)
    law = round_law(world, parents, sampled, None if sampled else _topk(world, parents))
    assert (law - world.target()).abs().max() > 1e-3


def test_residual_zero_normaliser_is_not_nan():
    r = torch.tensor([[0.2, 0.8, 0.0]])
    out = sampling.residual(r, r.clone())
    assert not out.isnan().any() and torch.equal(out, r)
    assert torch.allclose(sampling.residual(r, torch.tensor([[0.1, 0.9, 0.0]])), torch.tensor([[1.0, 0.0, 0.0]]))


def test_warp_top_p_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    full = logits.softmax(-1)[0]
    torch.testing.assert_close(warp(logits, 1.0)[0], full)
    keep2 = full[:2] / full[:2].sum()
    torch.testing.assert_close(warp(logits, 1.0, top_k=2)[0, :2], keep2)
    # top_p: the smallest set of most likely tokens reaching the mass (probabilities 0.644, 0.237, 0.087, 0.032)
    assert (warp(logits, 1.0, top_p=0.9)[0] > 0).tolist() == [True, True, True, False]
    assert (warp(logits, 1.0, top_p=0.85)[0] > 0).tolist() == [True, True, False, False]
    assert (warp(logits, 1.0, top_p=0.1)[0] > 0).tolist() == [True, False, False, False]
    torch.testing.assert_close(warp(logits, 0.5)[0], (logits * 2).softmax(-1)[0])


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_settings_are_one_user_error(bad):
    with pytest.raises(UserError, match=next(iter(bad))):
        SamplingConfig(**bad)


# -- 2. statistical: real q and p from a tiny verifier and random drafters ------------------------------------------

SAMPLES = 20_000
REAL = {"t1-top_k4": SamplingConfig(1.0, 1.0, 4), "t0.7-top_k4": SamplingConfig(0.7, 1.0, 4),
        "t1-top_p0.9-top_k6": SamplingConfig(1.0, 0.9, 6)}
DRAFTERS = ["medusa-chain-sampled", "medusa-tree-sampled", "medusa-tree-topk", "eagle-chain-sampled",
            "eagle-tree-topk", "eagle3-chain-sampled", "peagle-tree-sampled", "peagle-tree-topk",
            "dflash-tree-sampled"]


@pytest.fixture(scope="module")
def real_verifier():
    from helpers import varied_llama

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield varied_llama()
    torch.set_num_threads(before)


def _drafter(kind: str, verifier, cfg: SamplingConfig):
    from eval.drafters.build import make_drafter
    from eval.engine.tree import Chain, DynamicTree
    from models.eagle import build_eagle
    from models.medusa import MedusaHeads

    name, shape, proposals = kind.split("-")
    gen = torch.Generator().manual_seed(7)
    if name == "medusa":
        net = MedusaHeads(verifier.hidden_size, verifier.vocab_size, num_heads=2, num_layers=1)
        tree = Chain(2) if shape == "chain" else from_medusa_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    elif name == "peagle":  # one forward, two depths: a fixed tree like Medusa's
        from models.peagle import build_peagle

        net = build_peagle(verifier, 16, 2, draft_vocab_size=4096, aux_layer_ids=[0, 1])
        tree = Chain(2) if shape == "chain" else from_medusa_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    elif name == "dflash":  # one block forward, two drafts
        from models.dflash import build_dflash

        net = build_dflash(verifier, 16, block_size=3, aux_layer_ids=[0, 1])
        tree = Chain(2) if shape == "chain" else from_medusa_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    elif name == "dflash2":  # one block forward, then the selector over the top 8 given each parent
        from models.dflash2 import build_dflash2

        net = build_dflash2(verifier, 16, block_size=3, aux_layer_ids=[0, 1], selector_rank=16, selector_top_k=8)
        tree = Chain(2) if shape == "chain" else from_medusa_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    else:
        net = build_eagle(name, verifier, draft_vocab_size=4096 if name == "eagle3" else None,
                          aux_layer_ids=[0, 1] if name == "eagle3" else None)
        tree = Chain(2) if shape == "chain" else DynamicTree(size=6, depth=2, topk=3)
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        # a draft vocabulary that holds the verifier's likely tokens, and random others
        if name in ("eagle3", "peagle"):
            net.set_draft_vocab(torch.randperm(verifier.vocab_size, generator=gen)[:4096])
        if name == "peagle":  # its one random vector too: the same drafter whichever tests ran before (global RNG)
            net.mask_hidden.copy_(torch.randn(net.mask_hidden.shape, generator=gen) * 0.02)
    return make_drafter(name, verifier, tree, net=net, sampling=cfg if proposals == "sampled" else None,
                        generator=torch.Generator().manual_seed(8))


def _real_round(verifier, drafter, cfg: SamplingConfig, gen: torch.Generator):
    """Everything one round needs, from the real models: the draft's tree, a sampler of B drafts (tokens, p) and
    the warped verifier q at any path of depth <= 2 after prompt + root."""
    from eval.engine import hf_forward as kv

    tok = verifier.tokenizer
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    step = kv.forward(verifier.model, kv.new_cache(), ids, hidden_layers=drafter.feature_layers)
    seq = torch.cat([ids, step.logits[:, -1].argmax(-1, keepdim=True)], dim=1)  # a fixed root
    draft = drafter.propose(seq, step.hidden)
    parents, n = draft.tree.parents, draft.tree.num_nodes
    # The drafter's distribution at each node given its parent's token: Medusa's does not depend on it, EAGLE's
    # does (collected over repeated proposals until every depth-1 token it can draw has been seen).
    p_at: dict[tuple[int, int], torch.Tensor] = {}
    if draft.p is not None:
        for _ in range(400):
            for i in range(1, n):
                key = (i, int(draft.tokens[0, parents[i]]) if parents[i] else -1)
                p_at.setdefault(key, draft.p[0, i])
            support1 = set(p_at[(1, -1)].nonzero()[:, 0].tolist())
            if all((i, a) in p_at for i in range(1, n) if parents[i] for a in support1):
                break
            draft = drafter.propose(seq, step.hidden)
        else:
            raise AssertionError("the drafter never drew some of its depth-1 tokens")

    dists = [torch.zeros(verifier.vocab_size), *p_at.values()]  # index 0: the root's unused row
    which_of = {key: i + 1 for i, key in enumerate(p_at)}

    def sample(b: int) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """B drafts: tokens (B, N) and which of `dists` each node was drawn from (B, N), or None for top-k."""
        if draft.p is None:
            return draft.tokens.expand(b, n), None, dists
        tokens, which = torch.zeros(b, n, dtype=torch.long), torch.zeros(b, n, dtype=torch.long)
        for i in range(1, n):
            keys = [(i, -1)] * b if parents[i] == 0 else [(i, int(a)) for a in tokens[:, parents[i]]]
            which[:, i] = torch.tensor([which_of[k] for k in keys])
            for w in which[:, i].unique().tolist():  # per distribution, never a (B, V) matrix
                rows = (which[:, i] == w).nonzero()[:, 0]
                tokens[rows, i] = torch.multinomial(dists[w], rows.numel(), replacement=True, generator=gen)
        return tokens, which, dists

    def q_at(paths: list[tuple[int, ...]]) -> dict[tuple[int, ...], torch.Tensor]:
        """Warped q after prompt + root + path, for every path (depth <= 2), from one batched forward."""
        full = sorted({(path + (0, 0))[:2] for path in paths})
        logits = verifier.model(torch.cat([seq.expand(len(full), -1), torch.tensor(full)], dim=1)).logits[:, -3:]
        q = warp(logits, cfg.temperature, cfg.top_p, cfg.top_k)  # (F, 3, V)
        out = {}
        for f, pair in enumerate(full):
            for path in paths:
                if path == pair[: len(path)]:
                    out[path] = q[f, len(path)]
        return out

    return draft.tree, sample, q_at


def _compress(*tensors: torch.Tensor) -> torch.Tensor:
    """The tokens any of the distributions can give: every tensor is exactly zero elsewhere after top-k."""
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in tensors]).sum(0).nonzero()[:, 0]


def _speculative_pairs(verifier, kind: str, cfg: SamplingConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first two tokens after one sampled round, the same drawn from the verifier directly), (SAMPLES, 2) each."""
    from eval.engine.tree import tree_buffers

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tree, sample, q_at = _real_round(verifier, _drafter(kind, verifier, cfg), cfg, gen)
        tokens, which, dists = sample(SAMPLES)
        parents, n = tree.parents, tree.num_nodes
        node_paths = [[()] * n for _ in range(SAMPLES)]
        for b in range(SAMPLES):
            for i in range(1, n):
                node_paths[b][i] = node_paths[b][parents[i]] + (int(tokens[b, i]),)
        q0 = q_at([()])[()]
        wanted = {path for paths in node_paths for path in paths} | {(int(a),) for a in q0.nonzero()[:, 0]}
        qs = q_at(sorted(wanted))
    keep = _compress(torch.stack(list(qs.values())), *([] if which is None else [torch.stack(dists)]))
    # Compressed vocabulary: the support, plus one column U for every other token (q = p = 0 there: a top-k draft
    # outside q's support lands there and is never accepted; the rule only sees probabilities).
    index = torch.full((verifier.vocab_size,), keep.numel(), dtype=torch.long)
    index[keep] = torch.arange(keep.numel())
    pad = lambda t: torch.cat([t[..., keep], torch.zeros(*t.shape[:-1], 1)], dim=-1)  # noqa: E731
    q = torch.stack([torch.stack([pad(qs[path]) for path in paths]) for paths in node_paths])  # (B, N, U+1)
    pu = None if which is None else pad(torch.stack(dists))[which]  # (B, N, U+1)
    tok_u = index[tokens]
    acc = sampling.sample_accept(tree_buffers(tree).retrieve, parents, tok_u, q, pu, gen)
    retrieve = tree_buffers(tree).retrieve
    rows = torch.arange(SAMPLES)
    first = torch.where(acc.num_accepted >= 1, tok_u[rows, retrieve[acc.path, 1].clamp(min=0)], acc.next_token)
    second = torch.where(acc.num_accepted >= 2, tok_u[rows, retrieve[acc.path, 2 % retrieve.shape[1]].clamp(min=0)],
                         acc.next_token)
    # q after each first token (uniform where the verifier cannot emit it: only the negative control gets there)
    q1 = torch.stack([pad(qs[(int(a),)]) if (int(a),) in qs else torch.ones(keep.numel() + 1) for a in keep]
                     + [torch.ones(keep.numel() + 1)])  # (U+1, U+1)
    # Where the round stopped at the root, the second token is the next round's first: drawn from q (exact by 1.)
    second = torch.where(acc.num_accepted == 0, torch.multinomial(q1[first], 1, generator=gen)[:, 0], second)
    spec = torch.stack([first, second], dim=1)
    z1 = torch.multinomial(pad(q0).expand(SAMPLES, -1), 1, replacement=True, generator=gen)[:, 0]
    direct = torch.stack([z1, torch.multinomial(q1[z1], 1, generator=gen)[:, 0]], dim=1)
    return spec, direct


def _chi2_p(a: torch.Tensor, b: torch.Tensor) -> float:
    cells = sorted({tuple(x) for x in a.tolist()} | {tuple(x) for x in b.tolist()})
    at = {c: i for i, c in enumerate(cells)}
    table = torch.zeros(2, len(cells))
    for row, s in enumerate((a, b)):
        for c in s.tolist():
            table[row, at[tuple(c)]] += 1
    return float(chi2_contingency(table.numpy())[1])


@pytest.mark.parametrize("setting", REAL)
@pytest.mark.parametrize("kind", DRAFTERS)
def test_sampled_rounds_follow_the_verifier(real_verifier, kind, setting):
    spec, direct = _speculative_pairs(real_verifier, kind, REAL[setting], seed=11)
    assert _chi2_p(spec, direct) > 0.01


@pytest.mark.parametrize("kind", ["medusa-chain-sampled", "eagle-tree-topk", "peagle-tree-sampled",
                                  "dflash-tree-sampled"])
def test_sampled_rounds_negative_control_accept_all_fails(real_verifier, monkeypatch, kind):
    def accept_all(*args):
        plan = rejection_plan(*args)
        return RejectionPlan(torch.ones_like(plan.accept_prob), plan.final, plan.children)

    monkeypatch.setattr(sampling, "rejection_plan", accept_all)
    spec, direct = _speculative_pairs(real_verifier, kind, REAL["t1-top_k4"], seed=11)
    assert _chi2_p(spec, direct) < 1e-6


# -- 3. the decode loop and the harness --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["medusa-tree-sampled", "eagle-chain-sampled", "eagle3-chain-sampled",
                                  "peagle-tree-sampled", "eagle-tree-topk", "eagle-tree-sampled",
                                  "eagle3-tree-sampled"])
def test_sampled_speculative_decode_runs_with_every_drafter(real_verifier, kind):
    from eval.engine.decode import sample_decode, speculative_decode

    cfg = REAL["t1-top_p0.9-top_k6"]
    drafter = _drafter(kind, real_verifier, cfg)
    ids = torch.tensor([real_verifier.tokenizer("Hello, my name is")["input_ids"]])
    draft_seen = []
    propose = drafter.propose
    drafter.propose = lambda *a: draft_seen.append(propose(*a)) or draft_seen[-1]  # record, not replace
    out = speculative_decode(real_verifier, drafter, ids, 16, sampling=cfg, generator=torch.Generator().manual_seed(0))
    assert out.tokens.shape == (1, 16) and out.num_forwards < 17 and out.tau >= 1.0
    for draft in draft_seen:
        if kind.endswith("sampled"):  # each token was drawn from its row of p, a distribution over the vocabulary
            assert draft.p.shape == (*draft.tokens.shape, real_verifier.vocab_size)
            torch.testing.assert_close(draft.p[0, 1:].sum(-1), torch.ones(draft.tokens.shape[1] - 1))
            assert (draft.p[0, 1:].gather(-1, draft.tokens[0, 1:, None]) > 0).all()
        else:
            assert draft.p is None
    plain = sample_decode(real_verifier, ids, 16, sampling=cfg, generator=torch.Generator().manual_seed(0))
    assert plain.tokens.shape == (1, 16) and plain.num_forwards == 16


def test_temperature_zero_is_the_greedy_path(real_verifier):
    from eval.engine.decode import greedy_decode, sample_decode, speculative_decode

    ids = torch.tensor([real_verifier.tokenizer("Hello, my name is")["input_ids"]])
    greedy = greedy_decode(real_verifier, ids, 12).tokens
    drafter = _drafter("medusa-tree-topk", real_verifier, REAL["t1-top_k4"])
    for cfg in (None, SamplingConfig(temperature=0.0)):
        assert torch.equal(speculative_decode(real_verifier, drafter, ids, 12, sampling=cfg).tokens, greedy)
        assert torch.equal(sample_decode(real_verifier, ids, 12, sampling=cfg).tokens, greedy)


@pytest.mark.parametrize("override", ["temperature=-0.5", "top_p=0", "top_p=1.2", "top_k=-3", "temperature=hot"])
def test_harness_refuses_bad_sampling_options(override):
    from omegaconf import OmegaConf

    from eval.engine.sampling import sampling_config

    key, value = override.split("=")
    cfg = OmegaConf.create({key: OmegaConf.create({"v": value}).v if value == "hot" else float(value)})
    with pytest.raises(UserError, match=key):
        sampling_config(cfg)


def test_harness_sampling_record_marks_typical_lossy():
    from eval.engine.sampling import sampling_config
    from eval.runner import sampling_record

    assert sampling_record(sampling_config({"temperature": 0}))["rule"] == "greedy"
    exact = sampling_record(sampling_config({"temperature": 0.7, "top_p": 0.9}))
    assert exact["exact"] and not exact["lossy"]
    lossy = sampling_record(sampling_config({"temperature": 0.7, "typical": True}))
    assert lossy["lossy"] and not lossy["exact"] and "lossy" in lossy["rule"]


# -- 4. EAGLE dynamic trees with sampled drafts: siblings drawn without replacement ---------------------------------
# Exact: the real EagleDrafter (a random EAGLE-3 net with a 4-token draft vocabulary on the varied tiny verifier, q
# warped to top-k 4, so that every draft can be enumerated) proposes once per outcome of its draws, each draw scripted
# in turn (every ordered choice without replacement, weighted by the sequential law the Gumbel-top-k sampler has); the
# rule's exact law of the first two tokens must be warped q. Statistical: the Gumbel sampler itself drives a dynamic
# tree on the small World (the best-scoring first child is expanded), 20k rounds through `sample_accept`, chi-square
# against q.

DYNAMIC = {"t1": SamplingConfig(1.0, 1.0, 4), "t0.7-top_p0.9": SamplingConfig(0.7, 0.9, 4)}


def _scripted_rounds(verifier, cfg: SamplingConfig, monkeypatch) -> tuple[list, list[float], torch.Tensor]:
    """Every draft the sampled dynamic tree can propose after a fixed root: (drafts, their probabilities, seq)."""
    import eval.drafters.eagle as eagle
    from eval.drafters.build import make_drafter
    from eval.engine import hf_forward as kv
    from eval.engine.tree import DynamicTree
    from models.eagle import build_eagle

    gen = torch.Generator().manual_seed(7)
    net = build_eagle("eagle3", verifier, draft_vocab_size=4, aux_layer_ids=[0, 1])
    ids = torch.tensor([verifier.tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        for prm in net.parameters():
            if prm.ndim == 2:
                prm.copy_(torch.randn(prm.shape, generator=gen) * 0.1)
        step = kv.forward(verifier.model, kv.new_cache(), ids, hidden_layers=net.feature_layers)
        seq = torch.cat([ids, step.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        # A 4-token draft vocabulary: the verifier's 4 likeliest tokens after the root, so drafts and q overlap (a
        # random drafter over the whole vocabulary is rejected every time, and any rule then looks exact).
        net.set_draft_vocab(verifier.model(seq).logits[0, -1].topk(4).indices)
    # 2 children of the root; both expanded; the budget of 5 gives the better-scoring one 2 children, the other 1.
    drafter = make_drafter("eagle3", verifier, DynamicTree(size=5, depth=2, topk=2), net=net, sampling=cfg)

    script: list[int] = []
    drafts, weights = [], []
    while True:
        sizes, weight = [], [1.0]

        def scripted(p, k, generator=None):
            support = p.nonzero()[:, 0].tolist()
            options = list(itertools.permutations(support, min(k, len(support))))
            t = len(sizes)
            sizes.append(len(options))
            choice = options[script[t] if t < len(script) else 0]
            taken = 0.0
            for x in choice:  # the sequential law of draws without replacement
                weight[0] *= float(p[x]) / (1 - taken)
                taken += float(p[x])
            return torch.tensor(choice, dtype=torch.long)

        monkeypatch.setattr(eagle, "without_replacement", scripted)
        with torch.no_grad():
            drafts.append(drafter.propose(seq, step.hidden))
        weights.append(weight[0])
        full = script + [0] * (len(sizes) - len(script))
        while full and full[-1] + 1 >= sizes[len(full) - 1]:  # the next outcome, odometer style
            full.pop()
        if not full:
            break
        script = full[:-1] + [full[-1] + 1]
    monkeypatch.undo()
    return drafts, weights, seq


def _exact_dynamic_law(verifier, cfg: SamplingConfig, monkeypatch, control: str | None = None) -> tuple:
    """(law of the first two tokens (U+1, U+1), the verifier's own, number of outcomes) on a compressed vocabulary."""
    import eval.drafters.eagle as eagle

    if control == "iid_siblings":  # every sibling handed the undepleted p: the rule's i.i.d. assumption
        monkeypatch.setattr(eagle, "sibling_proposals", lambda p, kids: p.expand(len(kids), -1))
    drafts, weights, seq = _scripted_rounds(verifier, cfg, monkeypatch)  # (undoes the control's patch too)
    with torch.no_grad():
        q0 = warp(verifier.model(seq).logits[:, -1], cfg.temperature, cfg.top_p, cfg.top_k)[0]
        firsts = {(int(a),) for a in q0.nonzero()[:, 0]}
        paths = set(firsts)
        for d in drafts:
            paths |= set(_paths(d.tree.parents, d.tokens[0].tolist())[1:])
        q_of = {(): q0}  # warped q after seq + path, for every path of depth 1 or 2
        for path in sorted(paths):
            if path not in q_of:
                logits = verifier.model(torch.cat([seq, torch.tensor([path])], dim=1)).logits[:, -1]
                q_of[path] = warp(logits, cfg.temperature, cfg.top_p, cfg.top_k)[0]
    keep = _compress(torch.stack(list(q_of.values())), *[d.p[0, 1:] for d in drafts])
    index = torch.full((verifier.vocab_size,), keep.numel(), dtype=torch.long)
    index[keep] = torch.arange(keep.numel())
    u = keep.numel() + 1
    pad = lambda t: torch.cat([t[..., keep], torch.zeros(*t.shape[:-1], 1)], dim=-1).double()  # noqa: E731
    law = torch.zeros(u, u, dtype=torch.float64)
    q1 = {y: pad(q_of[(int(keep[y]),)]) for y in range(keep.numel()) if (int(keep[y]),) in q_of}
    for d, w in zip(drafts, weights):
        parents, toks = d.tree.parents, d.tokens[0].tolist()
        node_paths = _paths(parents, toks)
        q = torch.stack([pad(q_of[path]) for path in node_paths])[None]  # (1, N, U)
        p = pad(d.p[0])[None]
        plan = sampling.rejection_plan(parents, index[d.tokens], q, p)
        if control == "accept_all":
            plan = RejectionPlan(torch.ones_like(plan.accept_prob), plan.final, plan.children)
        _, stop = outcome_distribution(plan)
        for i, path in enumerate(node_paths):
            if not path:
                for y in range(keep.numel()):
                    if stop[0, 0, y] > 0:
                        law[y] += w * stop[0, 0, y] * q1[y]
            elif len(path) == 1:
                law[index[path[0]]] += w * stop[0, i]
            else:
                law[index[path[0]], index[path[1]]] += w * stop[0, i].sum()
    target = torch.zeros(u, u, dtype=torch.float64)
    for y in range(keep.numel()):
        if y in q1:
            target[y] = pad(q0)[y] * q1[y]
    return law, target, len(drafts)


@pytest.mark.parametrize("setting", DYNAMIC)
def test_eagle_dynamic_tree_sampled_exact_law_is_warped_q(real_verifier, monkeypatch, setting):
    law, target, outcomes = _exact_dynamic_law(real_verifier, DYNAMIC[setting], monkeypatch)
    assert outcomes >= 20  # the tree really varies: ordered sibling draws, and which parent gets two children
    assert abs(law.sum().item() - 1) < 1e-5
    torch.testing.assert_close(law, target, atol=1e-5, rtol=0)


@pytest.mark.parametrize("control", ["iid_siblings", "accept_all"])
def test_eagle_dynamic_tree_sampled_negative_controls_fail(real_verifier, monkeypatch, control):
    law, target, _ = _exact_dynamic_law(real_verifier, DYNAMIC["t1"], monkeypatch, control)
    assert (law - target).abs().max() > 1e-3, (law - target).abs().max()


def _dynamic_world_pairs(setting: tuple[float, float, int], seed: int, iid: bool = False):
    """20k rounds on the World: the root draws 3 children without replacement from p1 (Gumbel-top-k), the one with
    the highest p1 draws 2 from p2; each sibling handed `sibling_proposals` (or, with `iid`, the undepleted p)."""
    from eval.engine.acceptance.sampled import sibling_proposals, without_replacement
    from eval.engine.tree import Tree, tree_buffers

    world = World(seed, setting)
    gen = torch.Generator().manual_seed(seed)
    by_shape: dict[tuple, list] = {}
    for _ in range(SAMPLES):
        first = without_replacement(world.p1, 3, gen)
        best = int(world.p1[first].argmax())
        second = without_replacement(world.p2[first[best]], 2, gen)
        parents = (-1,) + (0,) * len(first) + (1 + best,) * len(second)  # fewer where top-p leaves fewer tokens
        sib = lambda p, kids: p.expand(len(kids), -1) if iid else sibling_proposals(p, kids)  # noqa: E731
        p = torch.cat([torch.zeros(1, V, dtype=torch.float64), sib(world.p1, first),
                       sib(world.p2[first[best]], second)])
        by_shape.setdefault(parents, []).append((torch.cat([torch.zeros(1, dtype=torch.long), first, second]), p))
    spec = []
    for parents, rows in by_shape.items():
        tokens = torch.stack([t for t, _ in rows])  # (B, N)
        p = torch.stack([p for _, p in rows])  # (B, N, V)
        paths = [_paths(parents, t.tolist()) for t in tokens]
        q = torch.stack([torch.stack([world.q_at(path) for path in ps]) for ps in paths])
        ranks = (-1, *range(parents.count(0)), *range(len(parents) - 1 - parents.count(0)))
        retrieve = tree_buffers(Tree(parents=parents, ranks=ranks)).retrieve
        acc = sampling.sample_accept(retrieve, parents, tokens, q, p, gen)
        b = torch.arange(len(rows))
        first_tok = torch.where(acc.num_accepted >= 1, tokens[b, retrieve[acc.path, 1].clamp(min=0)], acc.next_token)
        second_tok = torch.where(acc.num_accepted >= 2, tokens[b, retrieve[acc.path, 2].clamp(min=0)], acc.next_token)
        stopped = acc.num_accepted == 0  # the second token is the next round's first, from q
        after = torch.multinomial(world.q1[first_tok], 1, generator=gen)[:, 0]
        spec.append(torch.stack([first_tok, torch.where(stopped, after, second_tok)], dim=1))
    z1 = torch.multinomial(world.q0, SAMPLES, replacement=True, generator=gen)
    direct = torch.stack([z1, torch.multinomial(world.q1[z1], 1, generator=gen)[:, 0]], dim=1)
    return torch.cat(spec), direct


@pytest.mark.parametrize("setting", ["t1", "t0.7", "t1-top_p0.9"])
def test_dynamic_tree_sampled_without_replacement_follows_the_verifier(setting):
    spec, direct = _dynamic_world_pairs(SETTINGS[setting], seed=5)
    assert _chi2_p(spec, direct) > 0.01


def test_dynamic_tree_sampled_with_iid_siblings_fails():
    spec, direct = _dynamic_world_pairs(SETTINGS["t1"], seed=5, iid=True)
    assert _chi2_p(spec, direct) < 1e-6

"""Proof that sampled speculative decoding keeps the warped verifier distribution (eval.sampling).

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
import os

import pytest
import torch
from scipy.stats import chi2_contingency

import eval.sampling as sampling
from eval.sampling import RejectionPlan, SamplingConfig, outcome_distribution, rejection_plan, warp
from eval.tree import from_medusa_choices
from models.errors import UserError

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

"""The closed forms of eval/theory.py against exact enumeration through the real rule, and against measured runs.

1. Exact (1e-9): alpha = sum min(p, q) and E[tau] = (1 - alpha^(N+1)) / (1 - alpha) equal the rule's own
   probabilities (eval.engine.acceptance.sampled.rejection_plan / outcome_distribution) summed over every draft outcome.
2. Statistical (fixed seeds): alpha measured by running sample_accept is within 3 sd of the closed form, for random
   small pairs and for q from the tiny verifier perturbed into drafts of graded quality (alpha falling as KL grows);
   tau measured over rounds of N drafts is within 3 sd of the closed form. Negative control: a rule accepting with
   min(1, p/q) instead of min(1, q/p) must fail the same checks.
"""

from __future__ import annotations

import pytest
import torch

from eval.engine.sampling import warp
from eval.theory import (
    acceptance_rate,
    best_draft_length,
    enumerated_acceptance,
    enumerated_tokens,
    expected_tokens,
    kl_divergence,
    measure_acceptance,
    measure_tokens_per_call,
    mix_uniform,
    perturb,
    speedup,
    swapped_rule,
    tokens_variance,
    two_point_pair,
)

EXACT = 1e-9


def _pairs(v: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random pairs with and without zeros, p == q, disjoint supports, and a two-point pair."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for zeros in (0, 2):
        for _ in range(3):
            p, q = (torch.rand(v, generator=gen, dtype=torch.float64) for _ in range(2))
            if zeros:
                p[torch.randperm(v, generator=gen)[:zeros]] = 0
                q[torch.randperm(v, generator=gen)[:zeros]] = 0
            out.append((p / p.sum(), q / q.sum()))
    p = out[0][0]
    out.append((p, p.clone()))
    out.append((torch.tensor([0.5, 0.5, 0, 0, 0], dtype=torch.float64), torch.tensor([0, 0, 0.2, 0.3, 0.5],
                                                                                      dtype=torch.float64)))
    two_p, two_q = two_point_pair(0.7)
    out.append((torch.cat([two_p, torch.zeros(v - 3, dtype=torch.float64)]),
                torch.cat([two_q, torch.zeros(v - 3, dtype=torch.float64)])))
    return out


@pytest.mark.parametrize("index", range(9))
def test_closed_forms_equal_enumeration_through_the_rule(index):
    p, q = _pairs()[index]
    alpha = float(acceptance_rate(p, q))
    assert abs(alpha - float(enumerated_acceptance(p, q))) < EXACT
    for n in range(4):  # V^N draft chains, N i.i.d. drafts checked against the same q at every position
        assert abs(expected_tokens(alpha, n) - float(enumerated_tokens(p, q, n))) < EXACT, n


def test_two_point_pair_and_helpers():
    for a in (0.5, 0.7, 0.85):
        p, q = two_point_pair(a)
        assert abs(float(acceptance_rate(p, q)) - a) < EXACT
    p, q = _pairs()[0]
    assert float(kl_divergence(q, q)) == 0 and float(kl_divergence(q, p)) > 0
    assert float(kl_divergence(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0]))) == float("inf")
    assert expected_tokens(1.0, 4) == 5 and tokens_variance(1.0, 4) == 0
    assert speedup(0.8, 0, 0.1) == 1
    assert best_draft_length(0.8, 0.0, 10)[0] == 10  # a free draft: draft as far as allowed
    assert best_draft_length(0.3, 1.0, 10)[0] == 0  # a draft as slow as the verifier never pays


def _z(p: torch.Tensor, q: torch.Tensor, rule=None, samples: int = 4000, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    kwargs = {"rule": rule} if rule else {}
    measured, sd = measure_acceptance(p, q, samples, gen, **kwargs)
    return (measured - float(acceptance_rate(p, q).mean())) / sd


def test_measured_alpha_within_3_sigma_and_the_swapped_rule_is_caught():
    for i, (p, q) in enumerate(_pairs()[:6]):
        assert abs(_z(p[None], q[None], seed=i)) < 3, i
    caught = [abs(_z(p[None], q[None], rule=swapped_rule, seed=i)) > 3 for i, (p, q) in enumerate(_pairs()[:6])]
    assert all(caught), caught


@pytest.fixture(scope="module")
def tiny_q():
    """q from a tiny verifier at 16 positions of a fixed sequence, warped to its top 20 tokens. (16, V) float64
    initializer_range 0.5: peaky enough (top-1 about 0.3) that graded drafts span a wide range of alpha."""
    import os

    from models.verifiers.tiny import build_tiny

    verifier = build_tiny(cache_dir=os.environ.get("SPECDRAFT_CACHE"), dtype="float32", device="cpu", seed=1,
                          layer_std=0.3, initializer_range=0.5)
    ids = torch.randint(100, verifier.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = verifier.model(ids).logits[0, :, : verifier.vocab_size]
    return warp(logits, 1.0, top_k=20).double()


def test_alpha_falls_with_kl_on_the_tiny_verifier(tiny_q):
    noise = torch.randn(tiny_q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for family, grades in (("noise", [0.0, 0.5, 1.0, 2.0, 4.0]), ("mix", [0.0, 0.3, 0.6, 0.9])):
        kls, closed, measured = [], [], []
        for i, g in enumerate(grades):
            p = perturb(tiny_q, g, noise) if family == "noise" else mix_uniform(tiny_q, g)
            gen = torch.Generator().manual_seed(i)
            m, sd = measure_acceptance(p, tiny_q, 500, gen)
            kls.append(float(kl_divergence(tiny_q, p).mean()))
            closed.append(float(acceptance_rate(p, tiny_q).mean()))
            measured.append(m)
            assert abs(m - closed[-1]) < 3 * sd + EXACT, (family, g, m, closed[-1], sd)
            if g > 0:
                bad, bad_sd = measure_acceptance(p, tiny_q, 500, torch.Generator().manual_seed(i), rule=swapped_rule)
                assert abs(bad - closed[-1]) > 3 * bad_sd, (family, g, bad, closed[-1])  # the control is caught
        assert all(b > a for a, b in zip(kls, kls[1:])), (family, kls)
        assert all(b < a for a, b in zip(closed, closed[1:])), (family, closed)
        assert all(b < a for a, b in zip(measured, measured[1:])), (family, measured)


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.85])
def test_measured_tokens_per_call_within_3_sigma(alpha):
    p, q = two_point_pair(alpha)
    rounds = 4000
    for n in (1, 3, 6):
        sd = (tokens_variance(alpha, n) / rounds) ** 0.5
        measured, _ = measure_tokens_per_call(p, q, n, rounds, torch.Generator().manual_seed(n))
        assert abs(measured - expected_tokens(alpha, n)) < 3 * sd, (n, measured)
        bad, _ = measure_tokens_per_call(p, q, n, rounds, torch.Generator().manual_seed(n), rule=swapped_rule)
        assert abs(bad - expected_tokens(alpha, n)) > 3 * sd, (n, bad)  # the negative control is caught

"""The closed forms of speculative sampling, and measurements that run the real rule beside them.

Notation (the seed's; Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"): M_q is
the verifier with next-token probabilities q, M_p the draft with probabilities p, over one vocabulary.

- Acceptance rate of one draft token d ~ p under the rule "accept with probability min(1, q(d)/p(d))":

      alpha = E_{d~p}[min(1, q(d)/p(d))] = sum_x min(p(x), q(x)) = 1 - TV(p, q)          (Leviathan, Cor. 3.6)

- With N drafts per round whose acceptances are i.i.d. with rate alpha, the tokens emitted per verifier call
  (tau, counting the bonus token) is 1 + the number of leading accepted drafts, a geometric capped at N + 1:

      P(tau = k) = alpha^(k-1) (1 - alpha) for k <= N,  P(tau = N + 1) = alpha^N,
      E[tau] = (1 - alpha^(N+1)) / (1 - alpha)                                              (Leviathan, eq. 1)

- With c = (time of one M_p step) / (time of one M_q forward), and a verifier forward over N + 1 tokens costing the
  same as over one (the paper's assumption; on a CPU it is only roughly true), the expected wall-clock speedup of a
  round of N drafts + 1 verifier call over plain decoding is

      speedup(N) = (1 - alpha^(N+1)) / ((1 - alpha) (N c + 1)) = E[tau] / (1 + N c)          (Leviathan, Thm. 3.8)

The measurements (`measure_acceptance`, `measure_tokens_per_call`) draw drafts from p and run
`eval.engine.acceptance.sampled.sample_accept` on a chain, the rule the decode loop uses; `rule=` swaps in another for
negative controls. KL(q || p) = sum_x q(x) log(q(x)/p(x)) is the x-axis of the graded-drafter exercise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from eval.engine.acceptance.protocol import Acceptance
from eval.engine.acceptance.sampled import rejection_plan, sample_accept
from eval.engine.tree import chain, tree_buffers

Rule = Callable[..., Acceptance]  # sample_accept's signature: (retrieve, parents, tokens, q, p, generator)


# ---- closed forms --------------------------------------------------------------------------------------------------

def acceptance_rate(p: Tensor, q: Tensor) -> Tensor:
    """alpha = sum_x min(p(x), q(x)) over the last dim. (..., V) -> (...)"""
    return torch.minimum(p, q).sum(dim=-1)


def kl_divergence(q: Tensor, p: Tensor) -> Tensor:
    """KL(q || p) = sum_x q(x) log(q(x) / p(x)), with 0 log 0 = 0 (inf where p(x) = 0 < q(x)). (..., V) -> (...)"""
    terms = torch.where(q > 0, q * (q.log() - p.log()), torch.zeros_like(q))
    return terms.sum(dim=-1)


def expected_tokens(alpha: float, n: int) -> float:
    """E[tau] = (1 - alpha^(N+1)) / (1 - alpha): tokens per verifier call with N drafts (N + 1 when alpha = 1)."""
    if alpha == 1:
        return float(n + 1)
    return (1 - alpha ** (n + 1)) / (1 - alpha)


def tokens_variance(alpha: float, n: int) -> float:
    """Var[tau] under the capped geometric law in the module docstring."""
    law = [alpha ** (k - 1) * (1 - alpha) for k in range(1, n + 1)] + [alpha ** n]
    mean = sum(k * w for k, w in enumerate(law, start=1))
    return sum((k - mean) ** 2 * w for k, w in enumerate(law, start=1))


def speedup(alpha: float, n: int, c: float) -> float:
    """Leviathan et al. (2023), Theorem 3.8: E[tau] / (1 + N c), the expected wall-clock speedup over plain decoding
    with N drafts per round at cost ratio c = t(M_p step) / t(M_q forward)."""
    return expected_tokens(alpha, n) / (1 + n * c)


def best_draft_length(alpha: float, c: float, n_max: int = 16) -> tuple[int, float]:
    """(N, speedup) maximising `speedup` over N = 0..n_max (N = 0 is plain decoding, speedup 1)."""
    return max(((n, speedup(alpha, n, c)) for n in range(n_max + 1)), key=lambda t: t[1])


# ---- exact enumeration through the real rule ----------------------------------------------------------------------

def enumerated_acceptance(p: Tensor, q: Tensor) -> Tensor:
    """alpha by enumerating every draft x: sum_x p(x) * P(accept | x), P(accept | x) read from the chain plan of
    `eval.engine.acceptance.sampled.rejection_plan` (the probabilities `sample_accept` flips its coins with). p, q:
    (V,) -> ()"""
    v = p.shape[-1]
    tokens = torch.stack([torch.zeros(v, dtype=torch.long), torch.arange(v)], dim=1)  # (V, 2): root, draft x
    plan = rejection_plan(chain(1).parents, tokens, q.expand(v, 2, v), p.expand(v, 2, v))
    return (p * plan.accept_prob[:, 1]).sum()


def enumerated_tokens(p: Tensor, q: Tensor, n: int) -> Tensor:
    """E[tau] for N i.i.d. drafts from p checked against q at every position, by enumerating all V^N draft chains
    (weight prod p) and reading the exact law of the walk (`eval.engine.acceptance.sampled.outcome_distribution`'s
    reach)."""
    from eval.engine.acceptance.sampled import outcome_distribution

    v = p.shape[-1]
    chains = torch.cartesian_prod(*[torch.arange(v)] * n).reshape(-1, n) if n else torch.zeros(1, 0, dtype=torch.long)
    tokens = torch.cat([torch.zeros(len(chains), 1, dtype=torch.long), chains], dim=1)  # (V^N, N+1)
    weight = p[chains].prod(dim=1)  # (V^N,)
    plan = rejection_plan(chain(n).parents, tokens, q.expand(len(chains), n + 1, v), p.expand(len(chains), n + 1, v))
    reach, _ = outcome_distribution(plan)  # reach[:, 0] = 1 is the bonus token's share
    return (weight * reach.sum(dim=1)).sum()


# ---- graded drafts -------------------------------------------------------------------------------------------------

def perturb(q: Tensor, sigma: float, noise: Tensor) -> Tensor:
    """A draft of graded quality: p = softmax(log q + sigma * noise) (sigma = 0: p = q). Tokens with q = 0 keep p = 0,
    so p stays on q's support. q, noise: (..., V)."""
    logits = q.log() + sigma * noise
    return logits.softmax(dim=-1)


def mix_uniform(q: Tensor, lam: float) -> Tensor:
    """p = (1 - lam) q + lam * uniform over q's support (lam = 0: p = q)."""
    support = (q > 0).to(q.dtype)
    return (1 - lam) * q + lam * support / support.sum(dim=-1, keepdim=True)


def two_point_pair(alpha: float) -> tuple[Tensor, Tensor]:
    """(p, q) over 3 tokens with sum_x min(p(x), q(x)) = alpha: p = (alpha, 0, 1 - alpha), q = (alpha, 1 - alpha, 0).
    A draft is token 0 (always accepted) with probability alpha, else token 2 (q = 0: always rejected)."""
    p = torch.tensor([alpha, 0.0, 1 - alpha], dtype=torch.float64)
    q = torch.tensor([alpha, 1 - alpha, 0.0], dtype=torch.float64)
    return p, q


# ---- measurements with the real rule ------------------------------------------------------------------------------

def _support(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """Each row restricted to the tokens it gives mass under p or q (padded with zero columns to the widest row): the
    rule never draws, accepts or resamples a token with p = q = 0, so nothing it does changes. (C, V) -> (C, K)"""
    width = int(((p > 0) | (q > 0)).sum(dim=-1).max())
    if width == p.shape[-1]:
        return p, q
    keep = (p + q).topk(width, dim=-1).indices  # (C, K) every token with mass, then zeros
    return p.gather(-1, keep), q.gather(-1, keep)


def measure_acceptance(p: Tensor, q: Tensor, samples: int, generator: torch.Generator, rule: Rule = sample_accept,
                       chunk_elements: int = 2 ** 24) -> tuple[float, float]:
    """Measured alpha over contexts: for each of the C rows of p and q (C, V), draw `samples` drafts d ~ p and run
    `rule` on a one-draft chain; returns (accepted fraction, its standard deviation under the closed form,
    sqrt(mean_c alpha_c (1 - alpha_c) / (C * samples)))."""
    p, q = _support(p, q)
    ctx, v = p.shape
    draws = torch.multinomial(p, samples, replacement=True, generator=generator)  # (C, S)
    rows = torch.arange(ctx).repeat_interleave(samples)
    drafts = draws.reshape(-1)
    parents = chain(1).parents
    retrieve = tree_buffers(chain(1)).retrieve
    accepted = 0
    step = max(1, chunk_elements // (2 * v))
    for start in range(0, len(rows), step):
        r, d = rows[start:start + step], drafts[start:start + step]
        tokens = torch.stack([torch.zeros_like(d), d], dim=1)  # (B, 2): root, draft
        qn = q[r, None].expand(-1, 2, -1)  # (B, 2, V): node 0 checks the draft; node 1's row is the bonus token's
        pn = p[r, None].expand(-1, 2, -1)  # row 1: the law the draft was drawn from
        accepted += int(rule(retrieve, parents, tokens, qn, pn, generator=generator).num_accepted.sum())
    alpha = acceptance_rate(p, q).clamp(0, 1)  # sums of rounded probabilities can pass 1 by an ulp
    sd = math.sqrt(float((alpha * (1 - alpha)).mean()) / (ctx * samples))
    return accepted / (ctx * samples), sd


def measure_tokens_per_call(p: Tensor, q: Tensor, n: int, rounds: int, generator: torch.Generator,
                            rule: Rule = sample_accept) -> tuple[float, float]:
    """Measured tau: `rounds` rounds of N drafts, each drawn i.i.d. from p (V,) and checked against q (V,) by `rule`
    on a chain of N; returns (mean of num_accepted + 1, its standard error)."""
    v = p.shape[-1]
    drafts = torch.multinomial(p.expand(rounds, v), n, replacement=True, generator=generator) if n else \
        torch.zeros(rounds, 0, dtype=torch.long)
    tokens = torch.cat([torch.zeros(rounds, 1, dtype=torch.long), drafts], dim=1)  # (R, N+1)
    tree = chain(n)
    out = rule(tree_buffers(tree).retrieve, tree.parents, tokens, q.expand(rounds, n + 1, v),
               p.expand(rounds, n + 1, v), generator=generator)
    tau = (out.num_accepted + 1).double()
    return float(tau.mean()), float(tau.std() / math.sqrt(rounds))


def swapped_rule(retrieve: Tensor, parents: tuple[int, ...], tokens: Tensor, q: Tensor, p: Tensor | None,
                 generator: torch.Generator | None = None) -> Acceptance:
    """A WRONG rule for negative controls: accepts with min(1, p(d)/q(d)) (q and p swapped)."""
    return sample_accept(retrieve, parents, tokens, p, q, generator=generator)

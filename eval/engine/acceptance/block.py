"""Block verification: accept a drafted chain by a joint rule instead of token by token, still exact for warped q.

Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, 2024, "Block Verification Accelerates Speculative Decoding"
(arXiv 2403.10444), Algorithm 2, as vLLM 0.32 implements it (`rejection_sample_method="block"`,
vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py). Notation of this project (docs/development.md): M_q is the
verifier and q its (warped) probabilities, M_p the draft and p its probabilities. The paper writes M_b for q, M_s for
p and p_i for the running ratio below, which we call w_i (vLLM: `prefix_joint_ratio`, `cumulative_log_p` = log w_i).

A chain root X_0, drafts X_1..X_g (node i of the chain holds X_i). q_i = q(. | X_<=i) is the verifier at node i
(predicting X_{i+1}; q_g gives the bonus token) and p_i = p(. | X_<i) the distribution X_i was drawn from:

    w_0 = 1,   w_i = min(1, w_{i-1} * q_{i-1}(X_i) / p_i(X_i))                     (i = 1..g)
    m_i = sum_x max(w_i q_i(x) - p_{i+1}(x), 0)                                      (the residual mass, i < g)
    h_i = m_i / (m_i + 1 - w_i) for i < g  (1 where the denominator is 0: then w_i = 1),   h_g = w_g
    eta_1..eta_g ~ U(0, 1) independent;   tau = max{i in 1..g : eta_i <= h_i}, 0 if none
    emit X_1..X_tau, then Y ~ q_g if tau = g, else Y ~ norm(max(w_tau q_tau - p_{tau+1}, 0)).

Token by token (Leviathan / Chen: eval.engine.acceptance.sampled) stops at the first rejected draft; block
verification may accept draft i after rejecting an earlier one's coin, because the verdict on the prefix is joint. Its
output, the emitted prefix followed by the verifier's own continuation, still follows q exactly (paper, Theorem 1),
and its expected number of accepted drafts is the largest any exact rule can get from the same drafts (Theorem 2): never
below token by token. With deterministic drafts (p one-hot, top-k chains) w_i is q's probability of the drafted
prefix and the two rules accept equally often in law; the gain is for sampled drafts (`sampled_drafts=true`).

Greedy decoding (temperature 0) keeps eval.engine.acceptance.greedy.greedy_accept, as vLLM does: both rules are the
argmax match.

As in eval.engine.acceptance.sampled, every acceptance threshold and residual depends only on the draft, so `block_plan`
computes them at once; `sample_block` draws the coins and `block_outcome_distribution` gives the exact law of where
the block stops and what it emits (the tests' exact check). Block verification is defined on chains only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from eval.engine.acceptance.protocol import Acceptance, AcceptanceRule, SampledRule
from eval.engine.acceptance.sampled import check_draft_p
from eval.engine.protocol import Branching, Draft, Drafter
from runtime.errors import UserError


def chain_refusal(what: str) -> UserError:
    """The one error for block verification asked of a tree: `what` describes the tree seen."""
    return UserError(f"verify=block: block verification is defined on chains (one draft per depth), but {what}. "
                     f"Ask for a chain: drafter=export tree=chain for an export's drafter alone (tree.depth=N for N "
                     f"drafts; the hybrid grafts lookup chains into a tree), or a chain drafter (draft_model, "
                     f"prompt_lookup); or use verify=token, the default, which verifies trees.")


def check_chain(parents: tuple[int, ...] | list[int]) -> None:
    """Refuse a draft tree that is not a chain (node i's parent is i - 1 for every node after the root)."""
    if any(parent != i - 1 for i, parent in enumerate(parents) if i):
        raise chain_refusal(f"the draft is a tree of {len(parents)} nodes, "
                            f"{max(_depths(parents))} deep, parents {tuple(parents)}")


def may_branch(drafter: Drafter) -> bool:
    """Whether `drafter`'s rounds can be trees: more nodes than a chain of its depth holds (eval.engine.protocol's
    max_nodes / max_depth), or a drafter that says so (`branches = True`: one that grafts chains side by side within
    a chain's node count, as the hybrid does)."""
    return (isinstance(drafter, Branching) and drafter.branches) or drafter.max_nodes > drafter.max_depth + 1


def check_chain_drafters(rule: AcceptanceRule, drafters: Iterable[Drafter]) -> None:
    """A rule defined on chains (verify=block): refuse, before decoding, a drafter whose rounds can be trees
    (`may_branch`)."""
    if not rule.chains_only:
        return
    for drafter in drafters:
        if may_branch(drafter):
            policy = drafter.describe().get("policy") or type(drafter).__name__
            raise chain_refusal(f"the drafter (policy {policy}) proposes trees of up to {drafter.max_nodes} nodes, "
                                f"{drafter.max_depth} deep")


def _depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    return depths


@dataclass(frozen=True)
class BlockPlan:
    """Everything random in one block verification, computed from the draft alone (the module docstring's names).

    joint_ratio: (B, N) w_i at every node i of the chain (w_0 = 1).
    accept_prob: (B, N) h_i: the block's verdict reaches node i when eta_i <= h_i (h_0 = 1: the root always is).
    final: (B, N, V) where the next token is drawn from when the block stops at node i: the residual
        norm(max(w_i q_i - p_{i+1}, 0)) before the leaf, q at the leaf (the bonus token).
    """

    joint_ratio: Tensor
    accept_prob: Tensor
    final: Tensor


def block_plan(tokens: Tensor, q: Tensor, p: Tensor | None) -> BlockPlan:
    """Thresholds and residuals of block verification over a chain (module docstring).

    tokens: (B, N) the chain's tokens, node 0 the root. q: (B, N, V) warped verifier probabilities at every node
        (predicting the token after it). p: (B, N, V) the distribution each node's token was drawn from (row 0
        unused), or None for deterministic drafts (top-1: one-hot p).
    """
    bsz, n = tokens.shape
    drafts = tokens[:, 1:]  # (B, g)
    q_draft = q[:, :-1].gather(-1, drafts[..., None])[..., 0]  # (B, g) q_{i-1}(X_i): the verifier at the parent
    if p is None:
        drafted = torch.zeros_like(q[:, 1:]).scatter_(-1, drafts[..., None], 1.0)  # (B, g, V) one-hot p_i
        ratio = q_draft
    else:
        drafted = p[:, 1:].to(q.dtype)  # (B, g, V)
        p_draft = drafted.gather(-1, drafts[..., None])[..., 0]
        # p_i(X_i) = 0 cannot be drawn; as sample_accept, such a draft is not held against the prefix
        ratio = torch.where(p_draft > 0, q_draft / p_draft.clamp(min=torch.finfo(q.dtype).tiny), 1.0)
    w = [torch.ones(bsz, dtype=q.dtype, device=q.device)]
    for i in range(n - 1):
        w.append((w[-1] * ratio[:, i]).clamp(max=1))
    joint = torch.stack(w, dim=1)  # (B, N)
    left = (joint[:, :-1, None] * q[:, :-1] - drafted).clamp(min=0)  # (B, g, V) max(w_i q_i - p_{i+1}, 0)
    mass = left.sum(dim=-1)  # (B, g) m_i
    denom = mass + 1 - joint[:, :-1]
    h = torch.where(denom > 0, mass / denom.clamp(min=torch.finfo(q.dtype).tiny), 1.0)
    accept = torch.cat([h[:, :1].new_ones(bsz, 1), h[:, 1:], joint[:, -1:]], dim=1) if n > 1 else joint
    # Where m_i = 0 the block can only stop at i with probability 0 (then w_i = 1 and every later h is 1); q_i
    # stands in so that the residual is a distribution, not NaN.
    residual = torch.where(mass[..., None] > 0, left / mass.clamp(min=torch.finfo(q.dtype).tiny)[..., None],
                           q[:, :-1])
    final = torch.cat([residual, q[:, -1:]], dim=1)  # (B, N, V)
    return BlockPlan(joint_ratio=joint, accept_prob=accept, final=final)


def block_outcome_distribution(plan: BlockPlan) -> Tensor:
    """The exact law of one block verification: stop (B, N, V), stop[n, y] the probability that tau = n (the block
    is accepted through node n and no further) and y is emitted next. P(tau = n) = h_n prod_{j > n} (1 - h_j)."""
    h = plan.accept_prob
    later = torch.cat([(1 - h[:, 1:]).flip(1).cumprod(1).flip(1), h.new_ones(h.shape[0], 1)], dim=1)  # prod_{j>n}
    return (h * later)[..., None] * plan.final


def sample_block(plan: BlockPlan, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """One draw of block verification from its plan: (tau (B,), the next token (B,)). Coins eta_i ~ U[0, 1), one
    per draft; tau is the last node whose coin passes (eta_i < h_i has probability h_i exactly)."""
    h = plan.accept_prob
    bsz, n = h.shape
    eta = torch.rand(bsz, n, generator=generator, device=h.device, dtype=h.dtype)
    passed = eta < h
    passed[:, 0] = True  # tau >= 0
    tau = (passed.long() * torch.arange(n, device=h.device)).amax(dim=1)  # (B,) the last node that passed
    rows = torch.arange(bsz, device=h.device)
    next_token = torch.multinomial(plan.final[rows, tau], 1, generator=generator)[:, 0]
    return tau, next_token


def block_accept(retrieve: Tensor, parents: tuple[int, ...], tokens: Tensor, q: Tensor, p: Tensor | None,
                 generator: torch.Generator | None = None) -> Acceptance:
    """Block verification of a drafted chain (the module docstring's rule), exact for the warped q. Returns what
    eval.engine.acceptance.sampled.sample_accept returns; a tree that is not a chain is refused (`check_chain`).

    retrieve: (1, g+1) the chain's one root-to-leaf row (eval.engine.tree.tree_buffers). parents: the tree's
    parents. tokens, q, p: as in `block_plan`.
    """
    check_chain(parents)
    tau, next_token = sample_block(block_plan(tokens, q, p), generator)
    return Acceptance(path=torch.zeros_like(tau), num_accepted=tau, last_node=retrieve[0, tau], next_token=next_token)


class BlockVerification(SampledRule):
    """verify=block: `block_accept`, exact; chains only."""

    name, chains_only = "block verification (exact)", True

    def on_q(self, retrieve: Tensor, draft: Draft, q: Tensor, generator: torch.Generator | None) -> Acceptance:
        check_draft_p(draft.p, draft.tokens, q.shape[-1])
        return block_accept(retrieve, draft.tree.parents, draft.tokens, q, draft.p, generator)


"""Sampled acceptance: rules that keep the verifier's (warped) distribution exactly, and Medusa's lossy one.

Notation (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al., 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling"): M_q is the verifier and q its probabilities;
M_p is the draft and p its probabilities. Both are warped the same way (`warp`: temperature, top-k, top-p) before
acceptance, so the guarantee is for the warped verifier distribution, the one plain sampling draws from.

Chain (Leviathan / Chen): accept draft d_i with probability min(1, q_i(d_i) / p_i(d_i)); on the first rejection emit
a token from norm(max(q_i - p_i, 0)); if all N drafts pass, emit a bonus token from q_{N+1}.

Tree (multi-draft recursive rejection sampling: SpecInfer, Miao et al., 2024, "SpecInfer: Accelerating Large
Language Model Serving with Tree-based Speculative Inference and Verification", Alg. 2; EAGLE, Li et al., 2024): at
the current node, with residual r = q at that node, try its children in order: child c (token x, drawn from p_c) is
accepted with probability min(1, r(x) / p_c(x)), and the walk moves to c; on rejection r <- norm(max(r - p_c, 0)).
When every child is rejected (or there are none) the next token is drawn from r. Exact when sibling drafts are
independent draws from their p_c (sampled drafts), and when they are chosen deterministically (top-k): then p_c is
one-hot on x, the acceptance probability is r(x) and the residual is r with x zeroed, renormalised. A chain is the
tree whose nodes have one child each, where the rule is Leviathan / Chen's exactly.

Siblings sampled without replacement (Jeon et al., 2024, "Recursive Speculative Decoding: Accelerating LLM Inference
via Sampling Without Replacement"; SpecTr, Sun et al., 2023, for the optimal-transport view): the rule above needs
each child's token drawn from its own p_c given everything tried before it. For siblings x_1, x_2, ... drawn one
after another without replacement from the drafter's p, that is sibling i's `p_i` = p with x_1..x_{i-1} removed and
renormalised (`sibling_proposals`); `without_replacement` draws them (Gumbel-top-k, whose order is exactly that
sequential law). The one-step argument holds for any p_i as long as x_i ~ p_i given what came before: the walk
emits y with probability min(p_i(y), r_i(y)) + (1 - sum min(p_i, r_i)) * norm(max(r_i - p_i, 0))(y) = r_i(y).

Every acceptance probability and residual depends only on the draft, not on the coin flips before it (siblings are
tried in a fixed order), so `rejection_plan` computes them all at once; `sample_accept` walks the plan with coins and
`outcome_distribution` gives the exact law of where the walk stops and what it emits (the tests' exact check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from eval.engine.acceptance.protocol import Acceptance, SampledRule
from runtime.errors import UserError

if TYPE_CHECKING:
    from eval.engine.protocol import Draft


def residual(r: Tensor, p: Tensor) -> Tensor:
    """norm(max(r - p, 0)): what is left of r once a draft from p was rejected. Where the normaliser is 0 (p >= r
    everywhere, e.g. p == r, when rejection has probability 0 and is only reached through rounding) r is returned
    unchanged instead of NaN. (..., V) -> (..., V)"""
    left = (r - p).clamp(min=0)
    total = left.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, left / total.clamp(min=torch.finfo(left.dtype).tiny), r)


def without_replacement(p: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """Up to k distinct tokens drawn one after another without replacement from p (V,), in draw order: the k largest
    of log p + Gumbel noise (Gumbel-top-k; Kool et al., 2019). Fewer than k when p has fewer nonzero tokens. (m,)"""
    support = p.nonzero()[:, 0]  # noise for these alone: top-k / top-p leave few, and the rest can never be drawn
    u = torch.rand(support.shape, generator=generator, device=p.device, dtype=torch.float64)
    keys = p[support].double().log() - (-u.clamp(min=1e-300).log()).log()  # log p + Gumbel(0, 1)
    return support[keys.topk(min(k, support.numel())).indices]


def sibling_proposals(p: Tensor, tokens: Tensor) -> Tensor:
    """The distribution each of `tokens` (m,), drawn in order without replacement from p (V,), was drawn from:
    row i is p with tokens[:i] removed, renormalised -- what the rule must be given as sibling i's p. (m, V)"""
    m = tokens.shape[0]
    earlier = torch.ones(m, m, dtype=torch.bool, device=p.device).tril(-1)  # (m, m): j < i
    removed = torch.zeros(m, p.shape[-1], dtype=p.dtype, device=p.device)
    removed[:, tokens] = earlier.to(p.dtype)  # row i: 1 at tokens[j] for every j < i
    left = p[None] * (1 - removed)
    return left / left.sum(dim=-1, keepdim=True)


def children_table(parents: tuple[int, ...] | list[int]) -> Tensor:
    """(N, S) long: the children of each node in node order (the order they are tried), right-padded with -1."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, parent in enumerate(parents[1:], start=1):
        kids[parent].append(i)
    width = max((len(k) for k in kids), default=0)
    return torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.long).reshape(len(parents), width)


@dataclass(frozen=True)
class RejectionPlan:
    """Everything random in one round's tree walk, computed from the draft alone.

    accept_prob: (B, N) probability that node n is accepted when it is tried (node 0, the root, is 1).
    final: (B, N, V) the residual at node n after all its children were rejected: where the next token is drawn
        from when the walk stops at n (q at a leaf: the bonus token).
    children: (N, S) eval.engine.acceptance.sampled.children_table of the tree.
    """

    accept_prob: Tensor
    final: Tensor
    children: Tensor


def rejection_plan(parents: tuple[int, ...], tokens: Tensor, q: Tensor, p: Tensor | None) -> RejectionPlan:
    """Acceptance probabilities and residuals of recursive rejection sampling over a draft tree (module docstring).

    parents: the tree's parents (eval.engine.tree.Tree.parents), node 0 the root.
    tokens: (B, N) the token of every node. q: (B, N, V) warped verifier probabilities at every node (predicting
        the token after it). p: (B, N, V) the distribution each node's token was drawn from (row 0 unused), or None
        for deterministic drafts (top-k: one-hot p).
    """
    children = children_table(parents).to(tokens.device)
    bsz, n = tokens.shape
    accept = torch.ones(bsz, n, dtype=q.dtype, device=q.device)
    r = q.clone()  # (B, N, V) the running residual at every node
    for slot in range(children.shape[1]):
        has = children[:, slot] >= 0
        par, kid = has.nonzero()[:, 0], children[has, slot]  # (M,) parents with a slot-th child, and that child
        x = tokens[:, kid]  # (B, M)
        rx = r[:, par].gather(-1, x[..., None])[..., 0]  # (B, M)
        if p is None:  # one-hot p: accept with r(x); the residual is r without x, renormalised
            accept[:, kid] = rx.clamp(max=1)
            drafted = torch.zeros_like(r[:, par]).scatter_(-1, x[..., None], 1.0)  # (B, M, V)
        else:
            drafted = p[:, kid].to(r.dtype)  # (B, M, V)
            px = drafted.gather(-1, x[..., None])[..., 0]
            accept[:, kid] = torch.where(px > 0, rx / px.clamp(min=torch.finfo(px.dtype).tiny), 1.0).clamp(max=1)
        r[:, par] = residual(r[:, par], drafted)
    return RejectionPlan(accept_prob=accept, final=r, children=children)


def outcome_distribution(plan: RejectionPlan) -> tuple[Tensor, Tensor]:
    """The exact law of one round of the walk: (reach (B, N), stop (B, N, V)) where reach[n] is the probability the
    walk accepts node n (and all its ancestors) and stop[n, y] the probability it stops at n and emits y next."""
    accept, children = plan.accept_prob, plan.children
    bsz, n = accept.shape
    reach = torch.zeros_like(accept)
    reach[:, 0] = 1
    none_taken = torch.ones_like(accept)  # (B, N) probability that every child of n is rejected
    for node in range(n):  # parents come before children, so reach[node] is final here
        for kid in children[node].tolist():
            if kid < 0:
                break
            reach[:, kid] = reach[:, node] * none_taken[:, node] * accept[:, kid]
            none_taken[:, node] = none_taken[:, node] * (1 - accept[:, kid])
    return reach, (reach * none_taken)[..., None] * plan.final


def sample_accept(retrieve: Tensor, parents: tuple[int, ...], tokens: Tensor, q: Tensor, p: Tensor | None,
                  generator: torch.Generator | None = None) -> Acceptance:
    """Recursive rejection sampling over a draft tree (a chain included): the module docstring's rule, exact for the
    warped q. Returns what eval.engine.acceptance.greedy.greedy_accept returns, the next token sampled instead of the
    argmax.

    retrieve: (L, D+1) root-to-leaf node indices (eval.engine.tree.tree_buffers). tokens, q, p: as in `rejection_plan`.
    """
    plan = rejection_plan(parents, tokens, q, p)
    bsz, n = tokens.shape
    coins = torch.rand(bsz, n, generator=generator, device=q.device) < plan.accept_prob  # each node's coin if tried
    cur = torch.zeros(bsz, dtype=torch.long, device=q.device)
    depth = torch.zeros_like(cur)
    rows = torch.arange(bsz, device=q.device)
    for _ in range(retrieve.shape[1] - 1):
        kids = plan.children[cur]  # (B, S)
        if kids.shape[1] == 0:
            break
        ok = (kids >= 0) & coins.gather(1, kids.clamp(min=0))  # (B, S)
        moved = ok.any(dim=1)
        first = ok.long().argmax(dim=1)  # the first accepted child in order
        cur = torch.where(moved, kids[rows, first], cur)
        depth = depth + moved.long()
    next_token = torch.multinomial(plan.final[rows, cur], 1, generator=generator)[:, 0]  # (B,)
    # The retrieve row through the last accepted node: the first row holding it at its depth.
    hit = retrieve[:, depth].T == cur[:, None]  # (B, L)
    path = hit.long().argmax(dim=1)
    return Acceptance(path=path, num_accepted=depth, last_node=cur, next_token=next_token)


def typical_accept(retrieve: Tensor, tokens: Tensor, q: Tensor, posterior_threshold: float, posterior_alpha: float,
                   generator: torch.Generator | None = None) -> Acceptance:
    """Medusa's typical acceptance (Cai et al., 2024, section 2.3.1), LOSSY: a draft x is accepted when
    q(x) > min(posterior_threshold, posterior_alpha * exp(-H(q))) at its parent; the longest accepted path wins
    (ties: the first row of `retrieve`, as in greedy_accept), and the next token is sampled from q at its last node.
    Faster than rejection sampling at high temperature, but the output no longer follows q.

    q: (B, N, V) warped verifier probabilities at every node.
    """
    entropy = -(q * q.clamp(min=1e-30).log()).sum(dim=-1)  # (B, N)
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * (-entropy).exp())
    valid = retrieve >= 0  # (L, P)
    nodes = retrieve.clamp(min=0)
    path_tokens = tokens[:, nodes]  # (B, L, P)
    parent_q = q[:, nodes[:, :-1]]  # (B, L, P-1, V)
    prob = parent_q.gather(-1, path_tokens[:, :, 1:, None])[..., 0]  # (B, L, P-1) q(draft) at its parent
    match = (prob > threshold[:, nodes[:, :-1]]) & valid[None, :, 1:]
    lengths = match.long().cumprod(dim=-1).sum(dim=-1)  # (B, L)
    num_accepted, path = lengths.max(dim=-1)
    last_node = retrieve[path, num_accepted]
    rows = torch.arange(tokens.shape[0], device=q.device)
    next_token = torch.multinomial(q[rows, last_node], 1, generator=generator)[:, 0]
    return Acceptance(path=path, num_accepted=num_accepted, last_node=last_node, next_token=next_token)


def check_draft_p(p: Tensor | None, tokens: Tensor, vocab_size: int) -> None:
    """Refuse a draft distribution whose shape does not match the draft (a drafter bug, not a user's)."""
    if p is not None and p.shape != (*tokens.shape, vocab_size):
        raise UserError(f"Draft.p has shape {tuple(p.shape)} but the draft needs {(*tokens.shape, vocab_size)} "
                        f"(batch, nodes, verifier vocabulary); an EAGLE-3 drafter must map its draft vocabulary "
                        f"onto the verifier's (d2t).")


class RejectionSampling(SampledRule):
    """verify=token: recursive rejection sampling over the tree (`sample_accept`), exact."""

    name = "rejection sampling (exact)"

    def on_q(self, retrieve: Tensor, draft: Draft, q: Tensor, generator: torch.Generator | None) -> Acceptance:
        check_draft_p(draft.p, draft.tokens, q.shape[-1])
        return sample_accept(retrieve, draft.tree.parents, draft.tokens, q, draft.p, generator)


class TypicalAcceptance(SampledRule):
    """typical=true: Medusa's typical acceptance (`typical_accept`), LOSSY."""

    name, exact = "typical (lossy)", False

    def on_q(self, retrieve: Tensor, draft: Draft, q: Tensor, generator: torch.Generator | None) -> Acceptance:
        return typical_accept(retrieve, draft.tokens, q, self.sampling.posterior_threshold,
                              self.sampling.posterior_alpha, generator)

"""Acceptance losses between the draft's p and the verifier's q, fused and chunked, and D-PACE slot weights.

The acceptance rate of one drafted position under rejection sampling is the overlap alpha = sum_v min(p_v, q_v) =
1 - TV(p, q) (this project's notation, docs/development.md: q the verifier's, p the draft's). `model.loss=` picks what
a family minimises per position (the definitions of `speculators` 0.9, speculators/losses/eager.py):

    kl         sum_v q_v log(1/p_v): the cross-entropy to q, KL(q || p) + H(q) (today's loss; the gradient is KL's)
    rkl        KL(p || q) = sum_v p_v (log p_v - log q_v)
    jsd        0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2
    ce         -log p_y, y = q's argmax (the verifier's greedy token; Medusa: the data's token)
    tv         1 - alpha
    nla        -log max(alpha, 1e-5)                       (negative log-acceptance)
    lk_hybrid  lam KL(q || p) + (1 - lam)(1 - alpha), lam = exp(-eta sg[alpha])   (arXiv 2602.23881; eta: model.lk_eta)

Each is one function on a chunk of rows: the draft logits z (c, V) and q (c, V), returning the per-row loss, its
closed-form gradient dL/dz (for a loss L(p) with p = softmax(z): dL/dz = p * (g - <p, g>), g = dL/dp) and alpha.
`chunked_loss` (logits in hand) and `frozen_head_loss` (logits = hidden @ W^T through the verifier's frozen head)
drive them over chunks of rows, so no (N, V) tensor but the gradient itself (chunked_loss) or none at all
(frozen_head_loss) is held: the forward computes dL/dz and backward only scales it, as train/fused_head.py does.

D-PACE (`dpace_weights`): a block drafter's slot k is worth the tokens expected to be accepted from it on, the sum over
m >= k of the prefix products of the slots' acceptance probabilities; train/dflash.py weighs its slots' losses by it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from runtime.errors import UserError
from train.fused_head import (
    CHUNK,
    SOFT_CHUNK,
    FrozenHeadFunction,
    LogitsLossFunction,
    frozen_head_ce_alpha,
    soft_target_ce_alpha,
)

LOSSES = ("kl", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")
NLA_EPS = 1e-5  # speculators' clamp on alpha in -log(alpha)


def check_loss(name: object, key: str = "model.loss") -> str:
    """The loss name, or a UserError naming the choices."""
    if name not in LOSSES:
        raise UserError(f"{key}={name!r} is not a loss this toolkit trains with: pick one of {', '.join(LOSSES)} "
                        f"(train/losses.py; default kl).")
    return str(name)


def check_eta(eta: object, key: str = "model.lk_eta") -> float:
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not eta >= 0:
        raise UserError(f"{key}={eta!r}: lk_hybrid's blend lam = exp(-eta * alpha) needs a number >= 0 "
                        f"(default 3.0, the paper's).")
    return float(eta)


# -- one chunk of rows: (z (c, V) the draft logits, q (c, V) probabilities, y (c,) labels) -> (loss, dL/dz, alpha) --
def _softmax(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(p, log p, log-sum-exp (c,)) of logits z."""
    lse = z.logsumexp(-1)
    logp = z - lse[:, None]
    return logp.exp(), logp, lse


def _xlogx(q: Tensor) -> Tensor:
    """sum_v q_v log q_v per row, 0 log 0 = 0."""
    return torch.where(q > 0, q * q.clamp_min(torch.finfo(q.dtype).tiny).log(), 0.0).sum(-1)


def _tv_grad(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """alpha = sum min(p, q) and d(1 - alpha)/dz: g = -[p < q] (ties count as p >= q: the min is q's, no gradient)."""
    below = (p < q).to(p.dtype)
    alpha = torch.minimum(p, q).sum(-1)
    return alpha, p * ((p * below).sum(-1, keepdim=True) - below)


def kl_terms(z: Tensor, q: Tensor, y: Tensor | None, eta: float) -> tuple[Tensor, Tensor, Tensor]:
    p, _, lse = _softmax(z)
    return lse - torch.linalg.vecdot(q, z), p - q, torch.minimum(p, q).sum(-1)


def ce_terms(z: Tensor, q: Tensor, y: Tensor | None, eta: float) -> tuple[Tensor, Tensor, Tensor]:
    p, _, lse = _softmax(z)
    label = q.argmax(-1) if y is None else y
    rows = torch.arange(z.shape[0], device=z.device)
    grad = p.clone()
    grad[rows, label] -= 1.0
    return lse - z[rows, label], grad, torch.minimum(p, q).sum(-1)


def rkl_terms(z: Tensor, q: Tensor, y: Tensor | None, eta: float) -> tuple[Tensor, Tensor, Tensor]:
    p, logp, _ = _softmax(z)
    d = logp - q.clamp_min(torch.finfo(q.dtype).tiny).log()  # q = 0 reads as log tiny: a large, finite penalty
    loss = (p * d).sum(-1)
    return loss, p * (d - loss[:, None]), torch.minimum(p, q).sum(-1)


def jsd_terms(z: Tensor, q: Tensor, y: Tensor | None, eta: float) -> tuple[Tensor, Tensor, Tensor]:
    p, logp, _ = _softmax(z)
    logm = ((p + q) / 2).clamp_min(torch.finfo(p.dtype).tiny).log()
    loss = 0.5 * ((p * (logp - logm)).sum(-1) + _xlogx(q) - (q * logm).sum(-1))
    g = 0.5 * (logp - logm)  # dJSD/dp
    return loss, p * (g - (p * g).sum(-1, keepdim=True)), torch.minimum(p, q).sum(-1)


def tv_terms(z: Tensor, q: Tensor, y: Tensor | None, eta: float) -> tuple[Tensor, Tensor, Tensor]:
    p, _, _ = _softmax(z)
    alpha, grad = _tv_grad(p, q)
    return 1 - alpha, grad, alpha


def nla_terms(z: Tensor, q: Tensor, y: Tensor | None, eta: float) -> tuple[Tensor, Tensor, Tensor]:
    p, _, _ = _softmax(z)
    alpha, grad = _tv_grad(p, q)
    live = alpha > NLA_EPS  # below the clamp the loss is flat
    return -alpha.clamp_min(NLA_EPS).log(), grad * (live / alpha.clamp_min(NLA_EPS))[:, None], alpha


def lk_hybrid_terms(z: Tensor, q: Tensor, y: Tensor | None, eta: float) -> tuple[Tensor, Tensor, Tensor]:
    p, logp, _ = _softmax(z)
    alpha, tv_grad = _tv_grad(p, q)
    lam = torch.exp(-eta * alpha)[:, None]  # stop-gradient: a weight, not differentiated
    kl = _xlogx(q) - (q * logp).sum(-1)
    loss = lam[:, 0] * kl + (1 - lam[:, 0]) * (1 - alpha)
    return loss, lam * (p - q) + (1 - lam) * tv_grad, alpha


TERMS: dict[str, Callable[[Tensor, Tensor, Tensor | None, float], tuple[Tensor, Tensor, Tensor]]] = {
    "kl": kl_terms, "rkl": rkl_terms, "jsd": jsd_terms, "ce": ce_terms, "tv": tv_terms, "nla": nla_terms,
    "lk_hybrid": lk_hybrid_terms}


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for gradcheck


# -- the chunked drivers -----------------------------------------------------------------------------------------
class _ChunkedLoss(LogitsLossFunction):
    @staticmethod
    def forward(ctx, logits: Tensor, q: Tensor, index: Tensor | None, name: str, eta: float,
                chunk: int) -> tuple[Tensor, Tensor, Tensor]:
        n, wd = logits.shape[0], _work_dtype(logits.dtype)
        losses = torch.empty(n, dtype=wd, device=logits.device)
        alpha = torch.empty(n, dtype=wd, device=logits.device)
        argmax = torch.empty(n, dtype=torch.long, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        terms = TERMS[name]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = logits[s:e].to(wd)  # (c, V)
            qc = (q[s:e] if index is None else q.index_select(0, index[s:e])).to(wd)
            argmax[s:e] = z.argmax(-1)
            losses[s:e], g, alpha[s:e] = terms(z, qc, None, eta)
            if grad is not None:
                grad[s:e] = g
        return LogitsLossFunction.finish(ctx, grad, losses, argmax, alpha)


def chunked_loss(logits: Tensor, q: Tensor, index: Tensor | None = None, loss: str = "kl", eta: float = 3.0,
                 chunk: int = SOFT_CHUNK, want_alpha: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row `loss` between p = softmax(logits) (N, V) and q: (N, V) row by row, or with `index` (N,) row index[i]
    of q (M, V) for logits row i (gathered a chunk at a time). Rows of q sum to 1. Gradients flow to `logits`.

    Returns (losses (N,) fp32, p's argmax (N,), alpha (N,) = sum_v min(p_v, q_v), detached). `kl` runs
    train/fused_head.py's in-place chunk (today's path), which skips alpha with want_alpha=False (alpha empty)."""
    if loss == "kl":
        return soft_target_ce_alpha(logits, q, index, chunk, want_alpha)
    check_loss(loss)
    return _ChunkedLoss.apply(logits, q.detach(), index, loss, eta, chunk)


class _FrozenHeadLoss(FrozenHeadFunction):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor | None, teacher: Tensor | None, name: str,
                eta: float, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        n, wd = hidden.shape[0], _work_dtype(weight.dtype)
        h, grad, losses, argmax, target_argmax = FrozenHeadFunction.buffers(hidden, weight, wd)
        alpha = torch.empty(n, dtype=wd, device=h.device)
        terms = TERMS[name]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = (h[s:e] @ weight.T).to(wd)  # (c, V)
            argmax[s:e] = z.argmax(-1)
            if teacher is not None:
                q = (teacher[s:e].to(weight.dtype) @ weight.T).to(wd).softmax(-1)
                y = q.argmax(-1)
            else:  # hard labels: q is their one-hot
                assert labels is not None
                y = labels[s:e]
                q = torch.zeros_like(z).scatter_(1, y[:, None], 1.0)
            target_argmax[s:e] = y
            losses[s:e], g, alpha[s:e] = terms(z, q, y, eta)
            grad[s:e] = g.to(weight.dtype) @ weight
        return FrozenHeadFunction.finish(ctx, hidden, grad, losses, argmax, target_argmax, alpha)


def frozen_head_loss(hidden: Tensor, weight: Tensor, teacher: Tensor | None = None, labels: Tensor | None = None,
                     loss: str = "kl", eta: float = 3.0, chunk: int = CHUNK,
                     want_alpha: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row `loss` between p = softmax(hidden @ weight.T) and q = softmax(teacher @ weight.T) (teacher (N, D), no
    gradient) or the one-hot of `labels` (N,); `weight` (V, D) frozen; gradients flow to `hidden` only.

    Returns (losses (N,) fp32, p's argmax (N,), q's argmax or the labels (N,), alpha (N,), detached; `kl` skips
    alpha with want_alpha=False, as chunked_loss)."""
    if (labels is None) == (teacher is None):
        raise ValueError("frozen_head_loss needs exactly one of labels and teacher")
    if loss == "kl":
        return frozen_head_ce_alpha(hidden, weight, labels, teacher, chunk, want_alpha)
    check_loss(loss)
    return _FrozenHeadLoss.apply(hidden, weight.detach(), labels, None if teacher is None else teacher.detach(),
                                 loss, eta, chunk)


# -- acceptance: the expected accepted length of a chain, and D-PACE ---------------------------------------------
def chain_acceptance(alpha: Tensor) -> Tensor:
    """Expected accepted drafts of a chain whose depth k is accepted with probability alpha_k given depths < k are:
    sum_k prod_{j<=k} alpha_j, over the last axis. alpha (..., K) -> (...); add 1 (the bonus token) for tau."""
    return alpha.cumprod(-1).sum(-1)


def dpace_weights(conf: Tensor) -> Tensor:
    """D-PACE slot weights: weight_k = sum_{m>=k} prod_{j<=m} conf_j over the last axis (K slots), detached: the
    tokens expected to be accepted from slot k on, when slot j is accepted with probability conf_j given the slots
    before it are. conf (..., K) in [0, 1] -> (..., K)."""
    if conf.numel() and not bool(((conf >= 0) & (conf <= 1)).all()):
        bad = conf[(conf < 0) | (conf > 1) | conf.isnan()].flatten()[0]
        raise ValueError(f"dpace_weights reads acceptance probabilities in [0, 1]; saw {float(bad)}: pass "
                         f"probabilities (an overlap, or a confidence head's sigmoid), not logits.")
    prefix = conf.detach().cumprod(-1)
    return prefix.flip(-1).cumsum(-1).flip(-1)

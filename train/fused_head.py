"""Cross-entropy through a frozen vocabulary head, fused and chunked: the training step's largest cost, made lean.

Medusa heads with the verifier's shared lm_head, and EAGLE-1's draft logits (the verifier's lm_head again, trained
against q, which comes from the verifier's own hidden state through that same head), both end in

    loss_i = CE(softmax(h_i W^T), target_i),   W (V, D) frozen, V = 49,152 for SmolLM2, D = 576

with a hard label (Medusa) or a distribution (EAGLE-1: q_i = softmax(g_i W^T)). Through autograd this materialises
several (N, V) tensors per call: the bf16 logits, their fp32 copy, log-softmax, its gradient, a zero-filled one-hot
gradient, and they cost as much time as the two matmuls (measured on this CPU, 4 Medusa heads, 936 rows: matmuls 6.9
s of a 13.4 s step; the rest copies, fills, softmax passes and top-k). Here, per chunk of rows, one matmul gives the
logits, one in-place exp pass gives the softmax (and with it the log-sum-exp), and dL/dh = (softmax - target) W is
computed at once, in the forward: backward only scales it. No (N, V) tensor outlives its chunk. The arithmetic left is
the two (N, D) x (D, V) matmuls per call (three with q), which is what the issue means by "as lean as the arithmetic
allows" for a frozen head. Liger-Kernel's fused linear cross-entropy is the same idea for GPUs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

CHUNK = 512  # rows per chunk: a (512, 49152) fp32 block is 100 MB
SOFT_CHUNK = 64  # soft_target_ce's rows per chunk: a (64, 8192) fp32 block (2 MB) stays in cache


class FrozenHeadFunction(torch.autograd.Function):
    """A per-row loss through a frozen head `weight` (V, D) whose forward computes dL/dhidden chunk by chunk: what
    this file's and train/losses.py's share. `buffers`: the hidden rows in the head's dtype and the forward's outputs;
    `finish`: saves the gradient and returns (losses, p's argmax, the target's argmax, alpha); backward scales it."""

    @staticmethod
    def buffers(hidden: Tensor, weight: Tensor, dtype: torch.dtype
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """hidden in the head's dtype (N, D), dL/dh (N, D) to fill, the losses (N,) in `dtype` and the two argmaxes."""
        n = hidden.shape[0]
        h = hidden.to(weight.dtype)
        argmax, target_argmax = (torch.empty(n, dtype=torch.long, device=h.device) for _ in range(2))
        return h, torch.empty_like(h), torch.empty(n, dtype=dtype, device=h.device), argmax, target_argmax

    @staticmethod
    def finish(ctx: Any, hidden: Tensor, grad: Tensor, losses: Tensor, argmax: Tensor, target_argmax: Tensor,
               alpha: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ctx.save_for_backward(grad)
        ctx.dtype = hidden.dtype
        ctx.mark_non_differentiable(argmax, target_argmax, alpha)
        return losses, argmax, target_argmax, alpha

    @staticmethod
    def backward(ctx: Any, grad_losses: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        nones = (None,) * (len(ctx.needs_input_grad) - 1)  # the head, labels, teacher, settings: no gradient
        return ((grad.to(grad_losses.dtype) * grad_losses[:, None]).to(ctx.dtype), *nones)


class LogitsLossFunction(torch.autograd.Function):
    """A per-row loss of logits (N, V) whose forward computes dL/dlogits chunk by chunk (None where the logits need
    no gradient): what this file's soft-target cross-entropy and train/losses.py's chunked losses share. `finish`
    saves the gradient and returns (losses, p's argmax, alpha); backward scales it, in the gradient's own dtype (a
    mixed bf16 x fp32 product would cast the whole (N, V) tensor twice)."""

    @staticmethod
    def finish(ctx: Any, grad: Tensor | None, losses: Tensor, argmax: Tensor, alpha: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(argmax, alpha)
        return losses, argmax, alpha

    @staticmethod
    def backward(ctx: Any, grad_losses: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        nones = (None,) * (len(ctx.needs_input_grad) - 1)  # q, its index, settings: no gradient
        return (grad * grad_losses.to(grad.dtype)[:, None], *nones)


class _FrozenHeadCE(FrozenHeadFunction):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor | None, teacher: Tensor | None,
                chunk: int, want_alpha: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        n = hidden.shape[0]
        alpha = torch.empty(n if want_alpha else 0, dtype=torch.float32, device=hidden.device)
        h, grad, losses, argmax, target_argmax = FrozenHeadFunction.buffers(hidden, weight, torch.float32)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = (h[s:e] @ weight.T).float()  # (c, V)
            argmax[s:e] = logits.argmax(-1)
            if labels is not None:
                rows = torch.arange(e - s, device=h.device)
                picked = logits[rows, labels[s:e]]  # (c,)
                target_argmax[s:e] = labels[s:e]
            else:
                q = (teacher[s:e].to(weight.dtype) @ weight.T).float()
                target_argmax[s:e] = q.argmax(-1)
                q = q.softmax(-1)
                picked = (q * logits).sum(-1)  # sum_x q(x) logit(x)
            top = logits.amax(-1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place, one exp pass: the unnormalised softmax
            total = probs.sum(-1, keepdim=True)
            losses[s:e] = (top + total.log())[:, 0] - picked  # log-sum-exp - picked: -log p(label), or -sum q log p
            probs.div_(total)
            if want_alpha:  # sum_v min(p_v, q_v): p_label for a hard label
                alpha[s:e] = (probs[rows, labels[s:e]] if labels is not None
                              else torch.minimum(probs, q).sum(-1))
            if labels is not None:
                probs[rows, labels[s:e]] -= 1.0  # dL/dlogits = softmax - onehot
            else:
                probs.sub_(q)  # dL/dlogits = softmax - q
            grad[s:e] = probs.to(weight.dtype) @ weight
        return FrozenHeadFunction.finish(ctx, hidden, grad, losses, argmax, target_argmax, alpha)


def frozen_head_ce(hidden: Tensor, weight: Tensor, labels: Tensor | None = None, teacher: Tensor | None = None,
                   chunk: int = CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row cross-entropy of softmax(hidden @ weight.T) against `labels` (N,) or against softmax(teacher @
    weight.T) (teacher (N, D), no gradient); `weight` (V, D) is frozen. Gradients flow to `hidden` only.

    Returns (losses (N,) fp32, the draft's argmax (N,), the target's argmax (N,): `labels` itself, or q's argmax).
    """
    if (labels is None) == (teacher is None):
        raise ValueError("frozen_head_ce needs exactly one of labels and teacher")
    if teacher is not None:
        teacher = teacher.detach()
    losses, argmax, target_argmax, _ = _FrozenHeadCE.apply(hidden, weight.detach(), labels, teacher, chunk)
    return losses, argmax, target_argmax


def frozen_head_ce_alpha(hidden: Tensor, weight: Tensor, labels: Tensor | None = None, teacher: Tensor | None = None,
                         chunk: int = CHUNK, want_alpha: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`frozen_head_ce`, and alpha (N,) = sum_v min(p_v, q_v) (p of the label for labels), detached (empty with
    want_alpha=False): the `kl` path of train/losses.py's frozen_head_loss."""
    if (labels is None) == (teacher is None):
        raise ValueError("frozen_head_ce needs exactly one of labels and teacher")
    return _FrozenHeadCE.apply(hidden, weight.detach(), labels, None if teacher is None else teacher.detach(), chunk,
                               want_alpha)


class _SoftTargetCE(LogitsLossFunction):
    @staticmethod
    def forward(ctx, logits: Tensor, q: Tensor, index: Tensor | None, chunk: int,
                want_alpha: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        n = logits.shape[0]
        alpha = torch.empty(n if want_alpha else 0, dtype=torch.float32, device=logits.device)
        losses = torch.empty(n, dtype=torch.float32, device=logits.device)
        argmax = torch.empty(n, dtype=torch.long, device=logits.device)
        work = torch.empty((min(n, chunk), logits.shape[1]), dtype=torch.float32, device=logits.device)  # reused
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None  # dL/dlogits, in the logits' dtype
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            block = work[: e - s].copy_(logits[s:e])  # (c, V) fp32
            qc = q[s:e] if index is None else q.index_select(0, index[s:e])
            picked = torch.linalg.vecdot(qc, block)  # sum_x q(x) logit(x)
            top, argmax[s:e] = block.max(-1)  # ties: the first maximal index, as argmax
            probs = block.sub_(top[:, None]).exp_()  # the unnormalised softmax, one exp pass
            total = probs.sum(-1)
            losses[s:e] = top + total.log() - picked  # log-sum-exp - sum q logit = -sum q log p (q sums to 1)
            if want_alpha:
                probs.div_(total[:, None])
                alpha[s:e] = torch.minimum(probs, qc).sum(-1)  # sum_v min(p_v, q_v)
                total.fill_(1.0)  # probs is normalised already
            if grad is not None:
                grad[s:e] = probs.div_(total[:, None]).sub_(qc)  # dL/dlogits = softmax - q
        return LogitsLossFunction.finish(ctx, grad, losses, argmax, alpha)


def soft_target_ce(logits: Tensor, q: Tensor, index: Tensor | None = None,
                   chunk: int = SOFT_CHUNK) -> tuple[Tensor, Tensor]:
    """Per-row cross-entropy -sum_x q(x) log softmax(logits)(x) of `logits` (N, V) against the distributions `q`:
    q (N, V) row by row, or, with `index` (N,), row index[i] of q (M, V) for logits row i (the rows are gathered one
    chunk at a time, never as an (N, V) copy). Each row of q must sum to 1. Gradients flow to `logits` only.

    Same loss and gradient as `-(q * logits.float().log_softmax(-1)).sum(-1)` through autograd, in one chunked pass:
    the fp32 logits, the softmax and dL/dlogits = softmax - q share one buffer per chunk, and backward only scales the
    saved gradient (autograd's path keeps log-softmax, its gradient and the product, each (N, V)). Returns (losses (N,)
    fp32, the logits' argmax (N,))."""
    q = q.detach()
    losses, argmax, _ = soft_target_ce_alpha(logits, q, index, chunk, want_alpha=False)
    return losses, argmax


def soft_target_ce_alpha(logits: Tensor, q: Tensor, index: Tensor | None = None, chunk: int = SOFT_CHUNK,
                         want_alpha: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """`soft_target_ce`, and alpha (N,) = sum_v min(p_v, q_v), detached (empty with want_alpha=False): the `kl` path
    of train/losses.py's chunked_loss."""
    q = q.detach()
    if index is not None and index.numel() and bool((index.diff() == 1).all()):  # consecutive rows: a view, no gather
        q, index = q[int(index[0]) : int(index[0]) + index.numel()], None
    return _SoftTargetCE.apply(logits, q, index, chunk, want_alpha)

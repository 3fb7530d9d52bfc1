"""DFlash2Module: trains a DFlash2 drafter (models/dflash2.py) as speculators 0.9's recipe does.

The blocks are DFlash's (`models.dflash.block_rows`, sampled anchors; the convolutions run inside the network's block
forward). Per slot k (predicting x_{t+k+1}), two terms, both weighted step_decay^(k-1) (or by D-PACE, DFlashModule's
`slot_weighting`):
- the unary loss: DFlash's, the cross-entropy to q of lm_head(h_k) (`model.loss` another, train/losses.py);
- the selector loss, `selector_weight` times a K-way cross-entropy over the slot's top-K unary candidates re-scored by
  the selector given the previous target token x_{t+k} (teacher-forced; the root x_{t+1} for slot 1), the label the
  verifier's greedy token; where that token is not among the K, it replaces the K-th candidate (speculators'
  `selector_training_candidates`), so every row has a label. The candidates' unary logits keep their gradient, as
  speculators' `score_candidates` reads them.
Validation scores the draft decoding makes: the best of the unary top-K after re-scoring (no injected target), its
overlap sum_c min(p, q) over the K candidates (p the softmax of their scores), and ranks under the re-scored logits
(-inf outside the K): the tables tree planning reads (`eagle_topk_accuracy`, `val_step_top1`). `val/step{j}_unary_top1`
logs the unary argmax's top-1 beside it, what the selector adds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.dflash2 import DFlash2Net, build_dflash2
from models.eagle import UnrolledStep
from models.verifiers.core import Verifier
from train.dflash import DFlashModule, SlotTerms, check_weight
from train.losses import chunked_loss


def selector_labels(cand: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The K-way training candidates, the target's place among them, and whether unary top-K held it: where it did
    not, the target replaces the K-th candidate. cand (N, K), target (N,) -> (N, K), (N,), (N,)"""
    k = cand.shape[-1]
    match = cand == target[:, None]
    inside = match.any(-1)
    label = torch.where(inside, match.int().argmax(-1), k - 1)
    train = cand.clone()
    train[:, -1] = torch.where(inside, cand[:, -1], target)
    return train, label, inside


class DFlash2Module(DFlashModule):
    """Args: DFlash's (train/dflash.py, passed on as they are; no train_vocab: the selector's codebooks span the
    vocabulary), and
        conv_kernel_size, conv_group_size: the dynamic convolution's taps and channels per kernel (speculators: 2, 16).
        selector_rank, selector_top_k: the selector's codebook rank and the candidates it re-scores (256, 16).
        selector_weight: the selector loss's weight (speculators' selector_loss_alpha, 1.0).
    """

    def __init__(self, verifier: Verifier, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, conv_kernel_size: int = 2, conv_group_size: int = 16,
                 selector_rank: int = 256, selector_top_k: int = 16, selector_weight: float = 1.0,
                 **dflash: Any) -> None:
        check_weight("selector_weight", selector_weight, "the selector loss's weight")
        super().__init__(verifier, optimizer, scheduler, train_vocab=None, **dflash)
        self.replace_net(build_dflash2, conv_kernel_size, conv_group_size, selector_rank, selector_top_k)
        self.hparams.update(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                            selector_rank=selector_rank, selector_top_k=selector_top_k,
                            selector_weight=selector_weight)
        self._unary: Tensor | None = None  # validation: (hits, rows) of the unary argmax per slot

    @property
    def reads_alpha(self) -> bool:  # type: ignore[override]
        return True  # the overlaps are cheap here (K candidates), and D-PACE reads them

    def model_step(self, batch: dict[str, Tensor], steps: int, train: bool) -> dict[str, Any]:
        """DFlashModule.head_step for the selector's draft, the unary and selector losses in each slot's loss, both
        under the slot's weights."""
        return self.head_step(batch, steps, train)

    def slot_terms(self, j: int, step: UnrolledStep, q: Tensor, q_arg: Tensor, ids: Tensor, train: bool
                   ) -> SlotTerms:
        hp = self.hparams
        net: DFlash2Net = self.net
        bi, ti, h = step.batch, step.position, step.at_targets
        unary = net.logits(h, self.verifier.lm_head).float()  # (N, V)
        per_row, unary_arg, _ = chunked_loss(unary, q, None, loss=hp.get("loss", "kl"), eta=hp.get("lk_eta", 3.0),
                                             want_alpha=False)
        prev = ids[bi, ti + j + 1]  # the token before slot j+1: x_{t+j+1} (the root for slot 1)
        cand = net.candidates(unary.detach())  # (N, K)
        train_cand, label, _ = selector_labels(cand, q_arg)
        scores = net.candidate_selector.scores(unary, h, prev, train_cand)  # (N, K)
        sel = F.cross_entropy(scores, label, reduction="none")  # (N,)
        with torch.no_grad():  # the draft decoding makes: the best re-scored candidate of the unary top-K
            served = net.candidate_selector.scores(unary.detach(), h.detach(), prev, cand)  # (N, K)
            p_sel = served.softmax(-1)
            accept = torch.minimum(p_sel, q.gather(1, cand)).sum(-1)  # (N,) sum_c min(p, q)
            draft = cand.gather(1, served.argmax(-1, keepdim=True))[:, 0]
        terms = SlotTerms(per_row, sel, accept, draft, (unary.sum() + scores.sum()) * 0.0)
        if not train:
            if self._unary is None:
                self._unary = torch.zeros(net.parallel, 2, device=ids.device)
            self._unary[j] += torch.stack([(unary_arg == q_arg).sum().float(),
                                           torch.tensor(float(bi.numel()), device=ids.device)])
            terms.logits = torch.full_like(unary, float("-inf")).scatter_(1, cand, served)  # re-scored (N, V)
            terms.top1 = p_sel.amax(-1)
        return terms

    def head_term(self, j: int, head_loss: Tensor, weight: Tensor | float) -> Tensor:
        """The selector loss under the token loss's weights."""
        return self.hparams.selector_weight * self.global_mean((head_loss * weight).sum(), head_loss.numel())

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if self._unary is None:
            return
        agg = self.trainer.strategy.reduce(self._unary, reduce_op="sum")
        self._unary = None
        for j, (hits, rows) in enumerate(agg.tolist()):
            if rows:
                self.log(f"val/step{j}_unary_top1", hits / rows)

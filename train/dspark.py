"""DSparkModule: trains a DSpark drafter (models/dspark.py) as speculators 0.9's recipe does.

The backbone's blocks are DFlash's (`models.dflash.block_rows`, sampled anchors). Per slot k (predicting x_{t+k+1}):
- logits = lm_head(h_k) + MarkovBias(W1[x_{t+k}]): teacher-forced on the previous target token (the self-distilled
  data holds the verifier's own tokens), x_{t+1} (the root) for slot 1;
- the cross-entropy to q (the verifier's distribution at t+k; speculators' default `kl_div`, which differs from it by
  q's entropy, a constant; `model.loss` another, train/losses.py), weighted step_decay^(k-1) (speculators'
  fixed-exp-decay, gamma = 4: exp(-(k-1)/4)) or by D-PACE (`model.slot_weighting=dpace`, DFlashModule's);
- the confidence head's BCE against the detached acceptance 1 - TV(p_k, q_k) = sum_v min(p, q) of the Markov-corrected
  p, weighted step_decay^(k-1) (under D-PACE too, as speculators keeps it) and by `confidence_weight` (speculators'
  confidence_head_alpha, 1.0).
Validation logs each slot's top-1 and the tables DFlash logs, plus the confidence head's calibration per slot
(`val/slot{k}_confidence` beside `val/slot{k}_accept`), which the export records as `dspark_confidence` and
`dspark_accept_rate`, and `dspark_confidence_table`: eagle_topk_accuracy with each depth's top-1 cell replaced by the
head's mean predicted acceptance there (the table tree.size=auto plans on for this family, models/families.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.dspark import DSparkNet, build_dspark
from models.eagle import UnrolledStep
from models.verifiers.core import Verifier
from train.dflash import DFlashModule, SlotTerms, check_weight
from train.losses import chunked_loss


def slot_bias(net: DSparkNet, ids: Tensor, out: Tensor, bi: Tensor, ti: Tensor, col: Tensor, j: int
              ) -> tuple[Tensor, Tensor]:
    """Slot j+1's Markov bias and its previous token's W1 row for blocks whose context ends at ti (rows bi, slot
    column col in `out`), teacher-forced: the previous token is x_{t+j+1}. The rnn variant runs slots 1..j+1."""
    head = net.markov_head
    emb = head.embed(ids[bi, ti + j + 1])  # (N, r)
    if head.head_type != "rnn":
        return head.step(emb, out[bi, col])[0], emb
    state = None
    for k in range(j + 1):
        bias, state = head.step(head.embed(ids[bi, ti + k + 1]), out[bi, col - j + k], state)
    return bias, emb


def confidence_table(topk: list[list[float]], confidence: list[float]) -> list[list[float]]:
    """The per-depth cumulative top-k table with each depth's top-1 cell the head's mean predicted acceptance, the
    wider cells moved by the same amount (kept within [that cell, 1])."""
    out = []
    for row, c in zip(topk, confidence):
        shift = c - row[0]
        out.append([min(1.0, max(c, v + shift)) for v in row])
    return out


class DSparkModule(DFlashModule):
    """Args: DFlash's (train/dflash.py, passed on as they are: loss, lk_eta, slot_weighting, dpace_alpha included;
    no train_vocab: the Markov bias spans the whole vocabulary), and
        markov_rank: the rank r of the Markov bias (speculators 0.9: 256).
        markov_head_type: vanilla | gated | rnn (vLLM 0.32 serves vanilla).
        confidence_weight: the confidence BCE's weight (speculators' confidence_head_alpha).
    """

    def __init__(self, verifier: Verifier, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, markov_rank: int = 256,
                 markov_head_type: str = "vanilla", confidence_weight: float = 1.0, **dflash: Any) -> None:
        check_weight("confidence_weight", confidence_weight, "the confidence head's BCE weight")
        super().__init__(verifier, optimizer, scheduler, train_vocab=None, **dflash)
        self.replace_net(build_dspark, markov_rank, markov_head_type)
        self.hparams.update(markov_rank=markov_rank, markov_head_type=markov_head_type,
                            confidence_weight=confidence_weight)
        self._calib: dict[str, Tensor] = {}

    def model_step(self, batch: dict[str, Tensor], steps: int, train: bool) -> dict[str, Any]:
        """DFlashModule.head_step for the Markov-corrected logits, the confidence BCE in each slot's loss. `model.loss`
        picks the token loss (train/losses.py) and `slot_weighting=dpace` weighs it per block by D-PACE
        (DFlashModule.slot_weights, on the overlaps, as speculators' D-PACE reads the token loss, not the head); the
        BCE keeps the fixed decay step_decay^(k-1), as speculators keeps it."""
        return self.head_step(batch, steps, train)

    def slot_terms(self, j: int, step: UnrolledStep, q: Tensor, q_arg: Tensor, ids: Tensor, train: bool
                   ) -> SlotTerms:
        hp = self.hparams
        bi, ti = step.batch, step.position
        bias, emb = slot_bias(self.net, ids, step.out, bi, ti, step.column, j)
        logits = self.net.logits(step.at_targets, self.verifier.lm_head).float() + bias.float()  # (N, V)
        # (N,) each: the token loss, p's argmax, the overlap 1 - TV(p, q) = sum_v min(p, q) (detached)
        per_row, draft, accept = chunked_loss(logits, q, None, loss=hp.get("loss", "kl"),
                                              eta=hp.get("lk_eta", 3.0), want_alpha=True)
        accept = accept.float().clamp(0.0, 1.0)
        conf_logit = self.net.confidence_logit(step.at_targets, emb).float()
        bce = F.binary_cross_entropy_with_logits(conf_logit, accept, reduction="none")
        terms = SlotTerms(per_row, bce, accept, draft, (logits.sum() + conf_logit.sum()) * 0.0)
        if not train:
            self._tally(j, torch.sigmoid(conf_logit.detach()), accept, self.net.parallel)
            terms.logits = logits.detach()
            terms.top1 = terms.logits.softmax(-1).amax(-1)
        return terms

    def head_term(self, j: int, head_loss: Tensor, weight: Tensor | float) -> Tensor:
        """The BCE on the fixed decay whatever weighs the token loss (_loss multiplies by step_weight(j))."""
        fixed = self.hparams.step_decay**j / self.step_weight(j)
        return self.hparams.confidence_weight * fixed * self.global_mean(head_loss.sum(), head_loss.numel())

    def _tally(self, j: int, predicted: Tensor, accept: Tensor, steps: int) -> None:
        """Validation sums per slot: the head's predicted acceptance, the measured 1 - TV, and the rows."""
        if not self._calib:
            self._calib = {k: torch.zeros(steps, device=predicted.device) for k in ("pred", "accept", "rows")}
        self._calib["pred"][j] += predicted.sum()
        self._calib["accept"][j] += accept.sum()
        self._calib["rows"][j] += predicted.numel()

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if not self._calib:
            return
        agg = {k: self.trainer.strategy.reduce(v, reduce_op="sum") for k, v in self._calib.items()}
        self._calib = {}
        rows = agg["rows"].clamp(min=1)
        pred, accept = (agg["pred"] / rows).tolist(), (agg["accept"] / rows).tolist()
        for k, (c, a) in enumerate(zip(pred, accept), start=1):
            self.log(f"val/slot{k}_confidence", c)
            self.log(f"val/slot{k}_accept", a)
        if not self.trainer.sanity_checking and self.val_summary.get("eagle_topk_accuracy"):
            depth = self.net.parallel
            self.val_summary = {**self.val_summary, "dspark_confidence": pred[:depth],
                                "dspark_accept_rate": accept[:depth],
                                "dspark_confidence_table": confidence_table(
                                    self.val_summary["eagle_topk_accuracy"][:depth], pred[:depth])}

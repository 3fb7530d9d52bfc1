"""EagleModule: trains an EAGLE-1 or EAGLE-3 drafter on the frozen verifier's features.

Alignment (t = 0..T-2), as `models.eagle.unroll` runs it: step 0 at position t reads (token x_{t+1}, feature F_t) and
its output predicts x_{t+2}, i.e. matches q at position t+1; step j > 0 (training-time test, EAGLE-3) predicts
x_{t+j+2} from its own step j-1 output, seeing what it sees when drafting a chain at decode time.

Losses, on positions whose target is an assistant token:
- EAGLE-1: smooth L1 between the predicted feature and M_q's next feature (weight `feature_weight`) plus the
  cross-entropy of the draft distribution against q (weight `ce_weight`); uniform noise on the input features.
- EAGLE-3: per unrolled step j, weight step_decay^j, cross-entropy against q restricted to the draft vocabulary
  (positions whose q-argmax lies outside it are skipped, as in the reference).
`model.loss` swaps the cross-entropy to q for another acceptance loss (train/losses.py: kl, the default and today's
cross-entropy, rkl, jsd, ce, tv, nla, lk_hybrid with `model.lk_eta`), fused and chunked as the cross-entropy is.
The step, validation (`val_steps` steps: per-step top-1, the estimated tau, the expected accepted length) and the
export are every verifier-fed drafter's (train/verifier_fed.py); EAGLE-1's noise and feature regression are this
module's own hooks on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.eagle import UnrolledStep, build_eagle, eagle_class, unroll
from models.verifiers.core import Verifier
from train.verifier_fed import VerifierFedModule, check_head_args


class EagleModule(VerifierFedModule):
    """Args:
        verifier: the frozen M_q, held by reference (never in checkpoints).
        kind: `eagle` (EAGLE-1) or `eagle3` (EAGLE-3), the network this module builds.
        ttt_steps: unrolled training steps (EAGLE-3 default 7; EAGLE-1 trains on step 0 only).
        val_steps: steps unrolled in validation for per-step accuracy and the tau estimate.
        draft_vocab_size: EAGLE-3's reduced vocabulary, the most frequent target tokens of the training data.
        aux_layer_ids: EAGLE-3 feature layers (inputs of those layers); default [2, L//2, L-3].
        fc_norm, norm_output: EAGLE-3.1's fixes (EAGLE-3): normalise each verifier feature before fc; feed the
            final-normed output to the next unrolled step. Written into the export, which engines read.
        train_vocab: EAGLE-1: train and validate the draft logits over the N most frequent training targets' rows of
            the verifier's lm_head (q renormalised over the same rows); a verifier argmax outside them counts as a
            miss in validation. The export records N and the decoder drafts over the same rows. null: all V.
        loss: what each step minimises between p and q (train/losses.py): kl (default), rkl, jsd, ce (q's
            argmax as the label), tv, nla, lk_hybrid.
        lk_eta: lk_hybrid's eta in lam = exp(-eta * sg[alpha]) (the paper's 3.0).
        feature_weight, ce_weight, noise: EAGLE-1's feature regression weight, its token loss's weight, and the
            uniform noise on its input features (EAGLE-1's own parts: `prepare`, `feature_loss`, `weigh_terms`).
    """

    def __init__(self, verifier: Verifier, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, kind: str = "eagle", ttt_steps: int = 1,
                 val_steps: int = 5, step_decay: float = 0.8, feature_weight: float = 1.0, ce_weight: float = 0.1,
                 noise: float = 0.2, draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None,
                 warmup_ratio: float = 0.05, train_vocab: int | None = None, fc_norm: bool = False,
                 norm_output: bool = False, loss: str = "kl", lk_eta: float = 3.0) -> None:
        check_head_args(eagle_class(kind), train_vocab, loss, lk_eta)  # before the network's own checks
        net = build_eagle(kind, verifier, draft_vocab_size, list(aux_layer_ids) if aux_layer_ids else None,
                          fc_norm=fc_norm, norm_output=norm_output)
        super().__init__(verifier, optimizer, scheduler, net, ttt_steps=ttt_steps, val_steps=val_steps,
                         step_decay=step_decay, warmup_ratio=warmup_ratio, train_vocab=train_vocab, loss=loss,
                         lk_eta=lk_eta)

    def unrolled(self, feats: Tensor, ids: Tensor, attn: Tensor, loss_mask: Tensor, embed: torch.nn.Module,
                 steps: int, train: bool) -> Iterator[UnrolledStep]:
        """The training-time test (models.eagle.unroll): step j reads its own step j-1 output."""
        return unroll(self.net, feats, ids, attn, loss_mask, embed, steps)

    # -- EAGLE-1's own parts: noisy features, the feature regression -------------------------------------------------
    def prepare(self, batch: dict[str, Tensor], train: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The shared inputs, EAGLE-1's features with uniform noise in training (`noise`)."""
        ids, attn, loss_mask, final, feats = super().prepare(batch, train)
        if train and self.net.feature_noise and self.hparams.noise > 0:
            feats = feats + (torch.rand_like(feats) - 0.5) * self.hparams.noise
        return ids, attn, loss_mask, final, feats

    def feature_loss(self, h: Tensor, target: Tensor) -> Tensor | None:
        """EAGLE-1's smooth L1 between the predicted and M_q's next features (summed; weight `feature_weight`)."""
        if not self.hparams.feature_weight:
            return None
        return F.smooth_l1_loss(h.float(), target.float(), reduction="sum")

    def weigh_terms(self, token: Tensor, feature: Tensor | None, per_row: Tensor, size: int) -> Tensor:
        """feature_weight * the feature loss's mean + ce_weight * the token loss."""
        if feature is None:
            feature = per_row.sum() * 0.0
        feature = self.global_mean(feature, size)
        return self.hparams.feature_weight * feature + self.hparams.ce_weight * token

"""DFlashModule: trains a DFlash drafter (models/dflash.py) on the frozen verifier's features.

The loss and the tables are every verifier-fed drafter's (train/verifier_fed.py), through the verifier's own head:
per slot k, the cross-entropy to q at the position before its target (soft targets, through the frozen head, fused
and chunked; `model.loss` picks another acceptance loss, train/losses.py), weighted decay^(k-1) (`step_decay`,
exp(-1/4) as the paper sets it for blocks of 8; `slot_weighting: exp`) or by D-PACE (`slot_weighting: dpace`: slot k
weighs the tokens expected to be accepted from it on, `dpace_weights` of the slots' detached acceptance
probabilities, each smoothed to (1 - dpace_alpha) alpha + dpace_alpha as speculators does), no feature regression;
`model.train_vocab=N` trains over the N most frequent targets' rows of the head (FR-Spec) as it does for EAGLE-1.
Validation logs each slot's top-1, the estimated tau, the expected accepted length and the per-slot top-k table tree
planning reads. The forward is `models.dflash.block_rows`: sampled anchors, each block of [root, masks] attending its
context.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from models.dflash import block_rows, build_dflash
from models.eagle import UnrolledStep
from models.verifiers.core import Verifier
from runtime.errors import UserError
from train.losses import dpace_weights
from train.verifier_fed import StepTally, VerifierFedModule

SLOT_WEIGHTINGS = ("exp", "dpace")


def check_weight(name: str, value: Any, what: str) -> None:
    """A head's loss weight `model.<name>`: a number >= 0 (`what` says which loss and speculators' default)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise UserError(f"model.{name}={value!r}: {what} must be a number >= 0 (speculators: 1.0).")


@dataclass
class SlotTerms:
    """One slot's part of a training step for a block drafter with a head of its own (`DFlashModule.head_step`):
    rows (N,) each, the N blocks whose slot j has a target."""

    token_loss: Tensor  # the token loss per row (`model.loss` between the draft's distribution and q)
    head_loss: Tensor  # the family's own head's loss per row (DSpark's confidence BCE, DFlash2's selector CE)
    accept: Tensor  # the draft distribution's overlap with q, sum_v min(p, q), detached
    draft: Tensor  # the drafted token
    zero: Tensor  # 0 * (every output of the step): keeps each parameter in the graph where no row has a target
    logits: Tensor | None = None  # validation: the draft logits (N, V) the ranks are read under, detached
    top1: Tensor | None = None  # validation: the draft's top-1 probability


class DFlashModule(VerifierFedModule):
    """Args (beyond the optimiser's):
        mask_token_id: the token of every mask slot (SmolLM2: 16, `<empty_output>`; training refuses one the data
            holds as a target).
        block_size: the root and its K = block_size - 1 drafts (vLLM's speculative tokens for the export).
        num_layers: draft layers.
        aux_layer_ids: the verifier layers fused into the context (ids as EAGLE-3's: the input of layer k).
        num_anchors: blocks per sequence in a training step (validation: every anchor).
        step_decay: slot k's loss weight is step_decay^(k-1) (default exp(-1/4)), with slot_weighting=exp.
        train_vocab: as EAGLE-1's.
        loss, lk_eta: the loss per slot (train/losses.py), as VerifierFedModule's.
        slot_weighting: exp (step_decay^(k-1)) or dpace (per block, the expected tokens accepted from slot k on).
        dpace_alpha: D-PACE's smoothing of each slot's confidence c -> (1 - dpace_alpha) c + dpace_alpha
            (speculators' default 0.5), so that an untrained drafter's near-zero acceptance does not zero the weights.
    """

    def __init__(self, verifier: Verifier, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, mask_token_id: int = 16, block_size: int = 8,
                 num_layers: int = 1, aux_layer_ids: list[int] | None = None, num_anchors: int | None = 64,
                 step_decay: float = math.exp(-0.25), warmup_ratio: float = 0.05,
                 train_vocab: int | None = None, loss: str = "kl", lk_eta: float = 3.0,
                 slot_weighting: str = "exp", dpace_alpha: float = 0.5) -> None:
        if slot_weighting not in SLOT_WEIGHTINGS:
            raise UserError(f"model.slot_weighting={slot_weighting!r}: pick exp (step_decay^(k-1)) or dpace (the "
                            f"expected tokens accepted from each slot on).")
        if isinstance(dpace_alpha, bool) or not isinstance(dpace_alpha, (int, float)) or not 0 <= dpace_alpha <= 1:
            raise UserError(f"model.dpace_alpha={dpace_alpha!r}: D-PACE's smoothing is a share in [0, 1] "
                            f"(speculators' default 0.5).")
        net = build_dflash(verifier, mask_token_id, block_size, num_layers, aux_layer_ids)
        super().__init__(verifier, optimizer, scheduler, net, ttt_steps=net.parallel, val_steps=net.parallel,
                         step_decay=step_decay, warmup_ratio=warmup_ratio, train_vocab=train_vocab, loss=loss,
                         lk_eta=lk_eta)
        self.hparams.update(mask_token_id=mask_token_id, block_size=block_size, num_layers=num_layers,
                            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else None,  # plain, not a ListConfig
                            num_anchors=num_anchors, slot_weighting=slot_weighting,
                            dpace_alpha=dpace_alpha)

    def replace_net(self, build: Callable[..., Any], *own: Any) -> None:
        """A family built on DFlash's block (DSpark, DFlash2): its network `build(verifier, DFlash's block settings,
        *own)` in place of DFlash's."""
        hp = self.hparams
        self.net = build(self.verifier, hp.mask_token_id, hp.block_size, hp.num_layers, hp.aux_layer_ids, *own)

    # -- D-PACE ----------------------------------------------------------------------------------------------------
    @property
    def reads_alpha(self) -> bool:  # type: ignore[override]
        return self.hparams.get("slot_weighting") == "dpace"

    def slot_confidence(self, alpha: Tensor, valid: Tensor) -> Tensor:
        """Each slot's acceptance probability (S, B, n), given the steps' detached overlaps alpha = sum_v min(p, q)
        and valid targets: the overlap itself. A family with a confidence head (DSpark) returns the head's instead."""
        return alpha

    def slot_weights(self, alpha: Tensor, valid: Tensor) -> Tensor | None:
        """slot_weighting=dpace: per block (a position t), dpace_weights over its slots of the smoothed confidences,
        an invalid slot's counting as 0 (the chain stops there). exp: None (step_decay^(k-1) per slot)."""
        if self.hparams.get("slot_weighting") != "dpace":
            return None
        smooth = self.hparams.get("dpace_alpha", 0.5)
        conf = (1 - smooth) * self.slot_confidence(alpha, valid).detach().clamp(0, 1) + smooth
        conf = torch.where(valid, conf, 0.0)  # (S, B, n)
        return dpace_weights(conf.permute(1, 2, 0)).permute(2, 0, 1)

    def step_weight(self, j: int) -> float:
        """D-PACE's weights replace the fixed decay."""
        return 1.0 if self.hparams.get("slot_weighting") == "dpace" else super().step_weight(j)

    def unrolled(self, feats: Tensor, ids: Tensor, attn: Tensor, loss_mask: Tensor, embed: torch.nn.Module,
                 steps: int, train: bool):
        return block_rows(self.net, feats, ids, attn, loss_mask, embed, steps,
                          self.hparams.num_anchors if train else None)

    # -- a head of its own on DFlash's block (DSpark, DFlash2) -------------------------------------------------------
    def slot_terms(self, j: int, step: UnrolledStep, q: Tensor, q_arg: Tensor, ids: Tensor, train: bool
                   ) -> SlotTerms:
        """Slot j's terms (`head_step`), given its block rows `step`, the verifier's next-token distribution q (N, V)
        and its argmax, and the batch's tokens (teacher forcing). A family with its own head defines it."""
        raise NotImplementedError

    def head_term(self, j: int, head_loss: Tensor, weight: Tensor | float) -> Tensor:
        """Slot j's head loss as it enters the step's loss, given the token loss's row weights (D-PACE's, or 1.0)."""
        raise NotImplementedError

    def head_step(self, batch: dict[str, Tensor], steps: int, train: bool) -> dict[str, Any]:
        """VerifierFedModule.model_step's outputs (per-slot losses, top-1 hits, valid targets, alpha; validation:
        ranks and the draft's top-1 probability) for a block drafter whose draft comes through a head of its own:
        DFlash's blocks (`unrolled`), per slot `slot_terms`, the token loss weighted as `slot_weighting` says
        (D-PACE on the overlaps) plus `head_term`."""
        ids, attn, loss_mask, final, feats = self.prepare(batch, train)
        embed, lm_head = self.verifier.token_embedding, self.verifier.lm_head
        tally = StepTally(self.net.vocab_size)
        terms = []
        for j, step in enumerate(self.unrolled(feats, ids, attn, loss_mask, embed, steps, train)):
            bi, ti = step.batch, step.position
            with torch.no_grad():
                q = lm_head(final[bi, ti + j + 1]).float().softmax(-1)  # (N, V): the verifier's next token after t+j+1
                q_arg = q.argmax(-1)
            t = self.slot_terms(j, step, q, q_arg, ids, train)
            terms.append((t, bi, ti))
            if train:
                tally.add(step, t.draft == q_arg, t.accept)
                continue
            assert t.logits is not None and t.top1 is not None
            tally.add(step, t.draft == q_arg, t.accept, self.net.target_rank(t.logits, q_arg), t.top1)

        def step_loss(j: int, weights: Tensor | None) -> Tensor:
            t, bi, ti = terms[j]
            w = 1.0 if weights is None else weights[bi, ti]
            loss = self.global_mean((t.token_loss * w).sum(), t.token_loss.numel()) + self.head_term(j, t.head_loss, w)
            return loss if bi.numel() else t.zero

        return self.finish(tally, step_loss, train)

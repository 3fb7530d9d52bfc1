"""MedusaModule: trains Medusa heads on the frozen verifier's last hidden states.

Loss = sum_k decay^(k-1) * CE(head k logits at t, token t+k+1), over positions whose target is an assistant token.
Logged per head: loss, top-1 and top-5 accuracy; the full top-1..top-10 table of the last validation is written into
the export, where tree construction at decode time reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from data.hidden_cache import gather_layers
from models.exports.io import check_vocab_size, save_export
from models.medusa import MedusaHeads, medusa_targets
from models.verifiers.core import Verifier
from runtime.errors import NonFiniteLossError, UserError
from train.base import TOPK, DrafterModule
from train.export import data_record
from train.fused_head import frozen_head_ce
from train.safety import last_good_advice


class MedusaModule(DrafterModule):
    """Args:
        verifier: the frozen M_q, held by reference (never in checkpoints or hyperparameters).
        num_heads: K, the number of heads (head k predicts token t+k+1).
        num_layers: residual blocks per head.
        share_lm_head: reuse the verifier's frozen lm_head (default; cheap on CPU) or give each head its own
            projection initialised from it.
        optimizer: partial torch optimizer (`_partial_: true`).
        scheduler: partial LR schedule taking (optimizer, num_warmup_steps, num_training_steps), or None.
        decay: head k's loss weight is decay^(k-1), as in the Medusa reference.
        warmup_ratio: fraction of the optimisation steps spent in linear warmup.
        train_vocab: with the shared head, train (and validate) over the N tokens most often a training target
            only: the heads' logits are those N rows of the verifier's lm_head, a target outside them is dropped from
            the loss and counts as a miss in the accuracies. The export records it and the decoder drafts over the
            same rows (eval.drafters.build' draft_vocab). A training step then reads N x D head weights per head instead
            of V x D. null: the full vocabulary.
    """

    def __init__(
        self,
        verifier: Verifier,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        decay: float = 0.8,
        warmup_ratio: float = 0.05,
        num_heads: int = 4,
        num_layers: int = 1,
        share_lm_head: bool = True,
        train_vocab: int | None = None,
    ) -> None:
        super().__init__()
        if train_vocab is not None and not share_lm_head:
            raise UserError(f"model.train_vocab={train_vocab} cuts the verifier's shared lm_head, but "
                            f"model.share_lm_head=false gives each head its own full projection. Use one of the two.")
        if train_vocab is not None:
            check_vocab_size(train_vocab, verifier.vocab_size, "model.train_vocab")
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise UserError(f"model.num_heads={num_heads!r}: give a whole number of heads, at least 1 (default 4).")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not decay > 0:
            raise UserError(f"model.decay={decay!r}: head k's loss weight is decay^(k-1), so give a number above 0 "
                            f"(default 0.8).")
        # Plain values only: checkpoints must load with torch.load(weights_only=True) when resuming.
        self.save_hyperparameters(ignore=["verifier", "optimizer", "scheduler"], logger=False)
        self.verifier = verifier
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.heads = MedusaHeads(
            verifier.hidden_size, verifier.vocab_size, num_heads, num_layers, share_lm_head,
            lm_head_init=None if share_lm_head else verifier.lm_head.weight.detach().float(),
        )
        self.topk_accuracy: list[list[float]] | None = None
        self._val_hits: Tensor | None = None

    hidden_layers = [-1]  # verifier hidden states training reads: the final-normed last layer (the lm_head input)

    def activation_estimate(self, tokens: int, hidden: int, intermediate: int, width: int) -> tuple[float, str]:
        """train/memory.py's drafter row: each head's residual blocks keep about 4 H values per position."""
        heads = self.hparams.num_heads
        return int(heads) * tokens * 4 * hidden * width, f"~ {heads} heads x B x T x 4H x {width} B"

    # -- the shared step -------------------------------------------------------------------------------------------
    def model_step(self, batch: dict[str, Tensor], train: bool = False) -> tuple[Tensor, list[Tensor], Tensor, Tensor]:
        """Returns (loss, per-head losses, per-head hit counts (K, TOPK): top-1..top-10 in validation, top-1 only in
        training (K, 1), per-head counts (K,)). Training with the shared frozen head runs the fused, chunked
        cross-entropy (train/fused_head.py): same loss and gradient, without the (N, V) tensors. With `train_vocab`, the
        logits are the kept rows' only."""
        if self.verifier.device != self.device:
            self.verifier.to(self.device)
        hidden = gather_layers(batch, self.hidden_layers, self.verifier, [-1])[-1]  # (B, T, D), no grad
        lm_head, ids = self.verifier.lm_head, self.head_ids
        weight = lm_head.weight if ids is None else self.head_rows(lm_head.weight)  # (V or N, D), frozen
        K = self.heads.num_heads
        loss = hidden.new_zeros((), dtype=torch.float32)
        head_losses, hits, counts = [], [], []
        for k, (targets, valid) in enumerate(medusa_targets(batch["input_ids"], batch["loss_mask"], K)):
            tgt = targets[valid]  # (N,) verifier ids
            # Row indices into `weight`: the ids themselves, or their rows among head_ids (-1: not a drafting row).
            local = tgt if ids is None else self._local[tgt]
            kept = local >= 0
            if train and self.heads.share_lm_head and kept.any():
                feats = self.heads.head_features(hidden[valid] if ids is None else hidden[valid][kept], k)
                per_row, arg, _ = frozen_head_ce(feats, weight, labels=local[kept])
                ce = per_row.mean()
                loss = loss + self.hparams.decay**k * ce
                head_losses.append(ce.detach())
                hits.append((arg == local[kept]).float().sum()[None])  # a dropped target is a miss
                counts.append(torch.tensor(float(tgt.numel()), device=self.device))
                continue
            if self.heads.share_lm_head:
                logits = F.linear(self.heads.head_features(hidden[valid], k).to(weight.dtype), weight).float()
            else:
                logits = self.heads.head_logits(hidden[valid], k).float()  # (N, V): only assistant targets
            ce = F.cross_entropy(logits[kept], local[kept]) if kept.any() else logits.sum() * 0.0
            loss = loss + self.hparams.decay**k * ce
            head_losses.append(ce.detach())
            with torch.no_grad():
                top = logits.topk(min(1 if train else TOPK, logits.shape[-1]), dim=-1).indices  # (N, TOPK) rows
                hit_at = (top == local[:, None]).float().sum(0).cumsum(0)  # hits within top-1..top-TOPK (-1: none)
                hits.append(hit_at)
                counts.append(torch.tensor(float(tgt.numel()), device=self.device))
        return loss, head_losses, torch.stack(hits), torch.stack(counts)

    def _log_heads(self, stage: str, head_losses: list[Tensor], hits: Tensor, counts: Tensor, bsz: int) -> None:
        for k, ce in enumerate(head_losses):
            self.log(f"{stage}/head{k + 1}_loss", ce, batch_size=bsz)
            if stage == "train":
                self.log(f"train/head{k + 1}_top1", hits[k, 0] / counts[k].clamp(min=1), batch_size=bsz)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, head_losses, hits, counts = self.model_step(batch, train=True)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"training diverged at step {self.global_step}: the training loss is {loss.item()}. "
                f"{last_good_advice(self._trainer)}"
            )
        bsz = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bsz)
        self._log_heads("train", head_losses, hits, counts, bsz)
        self.count_depth1(hits[0, 0], counts[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, head_losses, hits, counts = self.model_step(batch)
        bsz = batch["input_ids"].shape[0]
        self.log("val/loss", loss, prog_bar=True, batch_size=bsz, sync_dist=True)
        self._log_heads("val", head_losses, hits, counts, bsz)
        if self._val_hits is None:
            self._val_hits, self._val_counts = hits.new_zeros(hits.shape), counts.new_zeros(counts.shape)
        self._val_hits += hits
        self._val_counts += counts

    def on_validation_epoch_end(self) -> None:
        if self._val_hits is None:
            return
        hits = self.trainer.strategy.reduce(self._val_hits, reduce_op="sum")
        counts = self.trainer.strategy.reduce(self._val_counts, reduce_op="sum")
        acc = hits / counts.clamp(min=1)[:, None]  # (K, TOPK): acc[k, i] = P(target in head k+1's top-(i+1))
        for k in range(acc.shape[0]):
            self.log(f"val/head{k + 1}_top1", acc[k, 0])
            self.log(f"val/head{k + 1}_top5", acc[k, min(4, acc.shape[1] - 1)])
        if not self.trainer.sanity_checking:
            self.topk_accuracy = acc.tolist()
        self._val_hits = None

    @property
    def drafter_kind(self) -> str:
        return "medusa"

    @property
    def drafter_net(self) -> torch.nn.Module:
        return self.heads

    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate"):
            self.setup_train_vocab(self.count_targets(self.heads.vocab_size))

    # -- export ----------------------------------------------------------------------------------------------------
    def export(self, path: str | Path) -> Path:
        """Write the heads in vLLM's Medusa layout, with the verifier fingerprint and per-head top-k accuracies."""
        extra = {"medusa_topk_accuracy": self.topk_accuracy, "trained_steps": self.trained_steps,
                 **self.train_vocab_record(),
                 **self.train_summary, **data_record(self._trainer)}
        return save_export(self.heads, self.verifier, path, extra, target_counts=self.target_counts)

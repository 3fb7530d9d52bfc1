"""Export on fit end: the trained drafter in its on-disk format, written atomically by the model family's `export`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from train.safety import DivergenceError, DivergenceGuard, last_good_advice


def data_record(trainer: L.Trainer | None) -> dict[str, int]:
    """What an export records of its training data: `train_tokens`, the assistant tokens (the ones with targets) of
    the training split, and `train_sequences`; empty when the module runs without a trainer's data module."""
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    ds = getattr(dm, "train_set", None)
    if ds is None:
        return {}
    return {"train_tokens": int(sum(sum(m) for m in ds["loss_mask"])), "train_sequences": len(ds)}


def last_batch(trainer: L.Trainer) -> bool:
    """Whether the training batch that just ended is the fit's last: it reached `max_steps`, or it ends the epoch
    that reaches `max_epochs`."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    epochs = trainer.max_epochs
    return (epochs is not None and 0 <= epochs <= trainer.current_epoch + 1
            and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


class ExportOnFitEnd(Callback):
    """Calls `pl_module.export(dirpath)` once training ends (on global rank 0 only), never from a diverged state:
    if a DivergenceGuard saw the run diverge or a weight is not finite, the previous export stays.

    The export carries what validation measured on the weights it writes (the acceptance tables eval plans its tree
    from), so the final weights are validated, however short the run. Lightning validates at an epoch's end or every
    `val_check_interval` batches; a run that stops elsewhere (`trainer.max_steps` inside an epoch, a last batch the
    interval does not reach, an epoch `check_val_every_n_epoch` skips) would export weights no validation saw, with
    no table. At the fit's last batch this asks the loop to stop there (`trainer.should_stop`, as early stopping
    does), which Lightning answers with one validation of the final weights: a run whose last batch validates anyway
    validates once."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.path: Path | None = None
        self.validated_step: int | None = None  # the global step of the last validation while fitting

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.fast_dev_run or not last_batch(trainer):
            return
        trainer.should_stop = True
        every = trainer.check_val_every_n_epoch
        if every and (trainer.current_epoch + 1) % every:  # an epoch that would not validate: this stop does
            trainer.check_val_every_n_epoch = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.validated_step = trainer.global_step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        diverged = any(isinstance(c, DivergenceGuard) and c.diverged for c in trainer.callbacks)
        bad = [n for n, p in pl_module.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
        if diverged or bad:
            what = f"non-finite weights in {bad[:3]}" if bad else "the run diverged"
            raise DivergenceError(f"not exporting to {self.dirpath}: {what}; the previous export is kept. "
                                  f"{last_good_advice(trainer)}")
        if trainer.is_global_zero:
            self.path = pl_module.export(self.dirpath)
            if self.validated_step != trainer.global_step and not trainer.fast_dev_run:
                print(f"[export] no validation ran on the final weights (step {trainer.global_step}; "
                      f"limit_val_batches={trainer.limit_val_batches}), so {self.path} has no acceptance table and "
                      f"eval's tree.size=auto cannot plan from it. Write it with: python train.py <this run's "
                      f"overrides> ckpt_path=last validate_only=true")
            if trainer.world_size > 1:
                print(f"[export] written by rank 0 of {trainer.world_size}: {self.path}")

"""Export on fit end: the trained drafter in its on-disk format, written atomically by the model family's `export`."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from train.safety import DivergenceError, DivergenceGuard, last_good_advice


def data_record(trainer: L.Trainer | None) -> dict[str, int]:
    """What an export records of its training data: `train_tokens`, the assistant tokens (the ones with targets) of
    the training split, and `train_sequences`; empty when the module runs without a trainer's data module."""
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    ds = getattr(dm, "train_set", None)
    if ds is None:
        return {}
    return {"train_tokens": int(sum(sum(m) for m in ds["loss_mask"])), "train_sequences": len(ds)}


class ExportOnFitEnd(Callback):
    """Calls `pl_module.export(dirpath)` once training ends (on global rank 0 only), never from a diverged state:
    if a DivergenceGuard saw the run diverge or a weight is not finite, the previous export stays."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.path: Path | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        diverged = any(isinstance(c, DivergenceGuard) and c.diverged for c in trainer.callbacks)
        bad = [n for n, p in pl_module.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
        if diverged or bad:
            what = f"non-finite weights in {bad[:3]}" if bad else "the run diverged"
            raise DivergenceError(f"not exporting to {self.dirpath}: {what}; the previous export is kept. "
                                  f"{last_good_advice(trainer)}")
        if trainer.is_global_zero:
            self.path = pl_module.export(self.dirpath)
            if trainer.world_size > 1:
                print(f"[export] written by rank 0 of {trainer.world_size}: {self.path}")

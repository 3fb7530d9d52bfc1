"""Export on fit end: the trained drafter in its on-disk format, written atomically by the model family's `export`."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from train.safety import DivergenceError, DivergenceGuard, last_good_advice


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

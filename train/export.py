"""Export on fit end: the trained drafter in its on-disk format, written atomically by the model family's `export`."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback


class ExportOnFitEnd(Callback):
    """Calls `pl_module.export(dirpath)` once training ends (on global rank 0 only)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.path: Path | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path = pl_module.export(self.dirpath)

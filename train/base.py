"""What every drafter training module shares: AdamW-style optimizer over the trainable parameters with a warmup
schedule, and the `train/tokens_per_s` log. The verifier is a plain object (never a submodule), so `parameters()`
are the drafter's own."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from torch import Tensor


class DrafterModule(L.LightningModule):
    """Subclasses set `self.optimizer_factory` (a partial optimizer), `self.scheduler_factory` (a partial schedule
    taking (optimizer, num_warmup_steps, num_training_steps), or None) and save `warmup_ratio` in their hparams."""

    _tick = 0.0

    def configure_optimizers(self) -> Any:
        opt = self.optimizer_factory(params=[p for p in self.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return opt
        total = int(self.trainer.estimated_stepping_batches)
        sched = self.scheduler_factory(opt, num_warmup_steps=int(self.hparams.warmup_ratio * total),
                                       num_training_steps=max(total, 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_start(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._tick = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Tensor], batch_idx: int) -> None:
        tokens = batch["attention_mask"].sum().item()
        self.log("train/tokens_per_s", tokens / (time.perf_counter() - self._tick), batch_size=1)

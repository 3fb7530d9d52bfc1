"""Training progress as plain lines, for logs: Lightning's progress bar draws nothing readable when stdout is a file
(CI, a batch job, `nohup`), so this callback prints one line every `every_steps` optimizer steps or `every_seconds`,
whichever comes first, and one for the last step:

    step 40/96  loss 3.412  assistant tok/s 391  elapsed 2m05s  eta 2m55s

`loss` is the module's last logged `train/loss`; assistant tok/s counts the loss-masked tokens (the ones with targets)
of this process's batches since the previous line, over wall time (data loading and validation included).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import lightning as L

from runtime.errors import UserError

WHEN = ("auto", "always", "never")


def duration(seconds: float) -> str:
    """1h02m, 2m05s or 7s."""
    s = int(seconds)
    h, m = s // 3600, s % 3600 // 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


class LogProgress(L.Callback):
    """Print a progress line every `every_steps` optimizer steps or `every_seconds`, whichever comes first (null or 0
    turns that trigger off). `when`: `auto` prints only when stdout is not a terminal (where the progress bar is
    drawn instead), `always`, or `never`. Only the global rank 0 prints."""

    def __init__(self, every_steps: int | None = 10, every_seconds: float | None = 30.0, when: str = "auto") -> None:
        if when not in WHEN:
            raise UserError(f"callbacks.progress.when={when!r}: use one of {', '.join(WHEN)}.")
        self.every_steps, self.every_seconds, self.when = every_steps or 0, every_seconds or 0.0, when
        self.active, self.tokens = False, 0  # tokens: assistant tokens since the last line
        self.start = self.last_time = 0.0
        self.first_step = self.last_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tty = sys.stdout.isatty()
        self.active = trainer.is_global_zero and (self.when == "always" or (self.when == "auto" and not tty))
        self.start = self.last_time = time.perf_counter()
        self.first_step = self.last_step = trainer.global_step  # a resumed run starts past 0
        self.tokens = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.active:
            return
        if isinstance(batch, dict) and "loss_mask" in batch:
            self.tokens += int(batch["loss_mask"].sum())
        step, now = trainer.global_step, time.perf_counter()
        if step == self.last_step:  # accumulating gradients: no optimizer step yet
            return
        if ((self.every_steps and step % self.every_steps == 0)
                or (self.every_seconds and now - self.last_time >= self.every_seconds)
                or step >= trainer.estimated_stepping_batches):
            self.report(trainer, step, now)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.active and trainer.global_step != self.last_step:  # stopped between two lines
            self.report(trainer, trainer.global_step, time.perf_counter())

    def report(self, trainer: L.Trainer, step: int, now: float) -> None:
        total = trainer.estimated_stepping_batches
        loss = trainer.callback_metrics.get("train/loss")
        elapsed, done = now - self.start, step - self.first_step
        rate = self.tokens / max(now - self.last_time, 1e-9)
        eta = duration(max(total - step, 0) * elapsed / done) if done and math.isfinite(total) else "?"
        print(f"step {step}/{total if math.isfinite(total) else '?'}  "
              f"loss {f'{float(loss):.3f}' if loss is not None else '?'}  assistant tok/s {rate:.0f}  "
              f"elapsed {duration(elapsed)}  eta {eta}", flush=True)
        self.last_step, self.last_time, self.tokens = step, now, 0

"""The run's training figures as a file: `<run>/training.json`, rewritten (atomically, by rank 0) after every epoch.

Per epoch: its wall seconds (first batch to the end of its validation, data loading included), the optimizer steps and
assistant tokens (the tokens with targets) it trained on, assistant tokens per wall second, the mean training loss over
its steps, and the last value of every scalar the module logged (training loss and accuracy, the held-out figures of the
epoch's validation). A resumed run reads the file and appends, so the epochs before a kill keep their figures; an epoch
resumed in the middle is marked `resumed` (its wall time covers only the part after the restart). A fresh run (no
checkpoint resumed) starts a record of its own: an earlier run's epochs in the file are never merged into it.
`scripts.tools.convert ship --training` puts the file beside a shipped export.

`BestCheckpoint` keeps `checkpoints/best.ckpt`, the weights of the validation with the best monitored figure
(conf/train.yaml: the largest `val/expected_accepted_length`), for the families whose validation reports it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


def cpu_kind() -> str:
    """The machine kind the figures were measured on (CPU flags decide bf16 matmul speed by ~5x)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16 without AMX" if "avx512_bf16" in flags else "other"
    return f"{platform.machine()} CPU, {kind}, {os.cpu_count()} cores"


class TrainingRecord(Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._start = 0.0
        self._tokens = 0
        self._steps = 0
        self._losses: list[float] = []
        self._resumed = False
        self._append = False  # the file holds this run's epochs (resumed, or written by an earlier epoch of it)

    def _read(self) -> dict[str, Any]:
        if self._append and self.path.is_file():
            try:
                return json.loads(self.path.read_text())
            except json.JSONDecodeError:  # a half-written file cannot happen (atomic writes); a hand-edited one can
                pass
        return {"epochs": []}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._resumed = trainer.global_step > 0
        self._append = bool(trainer.ckpt_path)  # set once the checkpoint is restored (None in `setup`)
        # An epoch resumed in the middle gets no on_train_epoch_start: its clock and step count start here.
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._tokens, self._steps = time.perf_counter(), 0, trainer.global_step
        self._losses = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if isinstance(batch, dict) and "loss_mask" in batch:
            self._tokens += int(batch["loss_mask"].sum().item())
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(float(loss.detach()))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tokens = int(trainer.strategy.reduce(torch.tensor(float(self._tokens)), reduce_op="sum"))  # every rank's
        if not trainer.is_global_zero:
            return
        seconds = time.perf_counter() - self._start
        metrics = {k: round(float(v), 6) for k, v in trainer.callback_metrics.items()
                   if isinstance(v, torch.Tensor) and v.numel() == 1 and "_step" not in k}
        epoch = {"epoch": trainer.current_epoch, "wall_s": round(seconds, 3),
                 "steps": trainer.global_step - self._steps, "assistant_tokens": tokens,
                 "assistant_tokens_per_wall_s": round(tokens / max(seconds, 1e-9), 1),
                 "train_loss_mean": round(sum(self._losses) / max(len(self._losses), 1), 6),
                 **({"resumed": True} if self._resumed else {}), "metrics": metrics}
        self._resumed = False
        record = self._read()
        record["epochs"] = [e for e in record["epochs"] if e["epoch"] != epoch["epoch"]] + [epoch]
        record |= {"family": type(pl_module).__name__, "max_epochs": trainer.max_epochs,
                   "global_step": trainer.global_step, "world_size": trainer.world_size,
                   "machine": cpu_kind(), "torch_threads": torch.get_num_threads(),
                   "wall_s_total": round(sum(e["wall_s"] for e in record["epochs"]), 3)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(self.path)
        self._append = True


class BestCheckpoint(ModelCheckpoint):
    """ModelCheckpoint saving after each validation, that stands aside for a module whose validation does not log its
    `monitor` (Medusa's heads report no expected accepted length): Lightning's own would stop such a run."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.monitor not in trainer.callback_metrics:
            return
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.monitor not in trainer.callback_metrics:
            return
        super().on_train_epoch_end(trainer, pl_module)

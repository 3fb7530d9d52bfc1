"""train/record.py: the per-epoch figures of training.json, for an epoch resumed in the middle too."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import torch

from train.record import TrainingRecord


class _Strategy:
    def reduce(self, value, reduce_op="sum"):
        return value


def _trainer(step: int, epoch: int = 0) -> SimpleNamespace:
    """A trainer at `step`: past step 0 it resumed from a checkpoint (its `ckpt_path`), as Lightning's does."""
    return SimpleNamespace(global_step=step, current_epoch=epoch, max_epochs=2, world_size=1, is_global_zero=True,
                           strategy=_Strategy(), callback_metrics={"val/loss": torch.tensor(1.5)},
                           ckpt_path="checkpoints/last.ckpt" if step else None)


def test_an_epoch_resumed_in_the_middle_counts_only_what_ran_after_the_restart(tmp_path):
    """Lightning resumes a checkpoint taken mid-epoch without calling on_train_epoch_start: the epoch's clock and
    steps must start at the restart (they counted from the process's clock origin and step 0: a 4-epoch run's last
    epoch read 63,501 s and every step of the run)."""
    record = TrainingRecord(str(tmp_path / "training.json"))
    module = torch.nn.Linear(1, 1)
    trainer = _trainer(step=700, epoch=3)
    record.on_train_start(trainer, module)  # restored at step 700, in the middle of epoch 3
    started = time.perf_counter()
    for _ in range(3):
        trainer.global_step += 1
        record.on_train_batch_end(trainer, module, {"loss": torch.tensor(2.0)},
                                  {"loss_mask": torch.ones(2, 4)}, 0)
    record.on_train_epoch_end(trainer, module)
    elapsed = time.perf_counter() - started
    epoch = json.loads((tmp_path / "training.json").read_text())["epochs"][-1]
    assert epoch["resumed"] is True and epoch["steps"] == 3 and epoch["assistant_tokens"] == 24
    assert 0 <= epoch["wall_s"] <= elapsed + 1.0, epoch
    assert epoch["train_loss_mean"] == 2.0


def test_a_fresh_epoch_is_timed_from_its_start(tmp_path):
    record = TrainingRecord(str(tmp_path / "training.json"))
    module = torch.nn.Linear(1, 1)
    trainer = _trainer(step=0)
    record.on_train_start(trainer, module)
    record.on_train_epoch_start(trainer, module)
    trainer.global_step = 5
    record.on_train_batch_end(trainer, module, {"loss": torch.tensor(1.0)}, {"loss_mask": torch.ones(1, 3)}, 0)
    record.on_train_epoch_end(trainer, module)
    epoch = json.loads((tmp_path / "training.json").read_text())["epochs"][-1]
    assert "resumed" not in epoch and epoch["steps"] == 5 and epoch["assistant_tokens"] == 3

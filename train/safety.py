"""Training that fails safe: a divergence guard that keeps the last good checkpoint apart, a lock per run directory,
checks that the places a run writes to are writable before any work starts, and checkpoints written beside their
destination and renamed into place, so a failed write (a full disk) never replaces the previous one.

What a diverged run leaves: `checkpoints/last-good.ckpt` (the newest checkpoint whose weights were seen to give a
healthy loss), `checkpoints/diverged.ckpt` (what `last.ckpt` held when the guard fired, kept for inspection), no
`last.ckpt`, and the previous export untouched. The error names the good checkpoint to resume from.
"""

from __future__ import annotations

import errno
import fcntl
import io
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.experimental.callback import Callback as HydraCallback
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO

from runtime.errors import NonFiniteLossError, UserError, exit_on_user_error
from train.muon import MuonAdamW

LAST_GOOD = "last-good.ckpt"
CANDIDATE = ".candidate.ckpt"
DIVERGED = "diverged.ckpt"


class DivergenceError(UserError):
    """Training diverged (loss far above its running level, or non-finite gradients or weights)."""


def last_good_advice(trainer: L.Trainer | None) -> str:
    """What to do after a divergence: resume from the last good checkpoint, if the run has one."""
    muon = trainer is not None and any(isinstance(o, MuonAdamW) for o in getattr(trainer, "optimizers", []))
    lrs = "model.optimizer.lr and model.optimizer.adamw_lr" if muon else "model.optimizer.lr"
    base = f"Lower {lrs} (or use trainer.precision=32-true)"
    guard = next((c for c in trainer.callbacks if isinstance(c, DivergenceGuard)), None) if trainer else None
    if guard is None or guard.dirpath is None:
        return f"{base}."
    good = guard.dirpath / LAST_GOOD
    if good.is_file() and guard.good_step is not None:
        return f"{base} and resume from the last good checkpoint (step {guard.good_step}): ckpt_path={good}"
    return f"{base} and start again with ckpt_path=null: no checkpoint of this run was seen to be healthy."


class DivergenceGuard(Callback):
    """Stop training before a diverged state is saved as good or exported.

    Checks, every step: the loss is finite and at most `factor` x its running level (an EMA of the healthy losses,
    floored at `floor`, checked once `warmup_steps` losses were seen), before backward; the gradient norm and the
    weights are finite, before the optimizer step. Every `every_n_train_steps` steps the guard saves the weights as a
    candidate; the candidate becomes `last-good.ckpt` once the next step's loss, computed with those weights,
    passes the checks. On a failure it moves `last.ckpt` aside to `diverged.ckpt` and raises DivergenceError, so
    the export callback never runs and `ckpt_path=last` cannot pick up diverged weights.

    Args:
        factor: stop when loss > factor x max(EMA, floor).
        floor: lower bound of the running level, so a near-zero loss does not make every later loss look huge.
        warmup_steps: losses seen before the ratio check starts (non-finite values are checked from step 0).
        ema_decay: weight of the old level in the EMA.
        every_n_train_steps: how often a candidate is saved; null: the checkpoint callback's cadence.
    """

    def __init__(self, factor: float = 1e3, floor: float = 1.0, warmup_steps: int = 1, ema_decay: float = 0.9,
                 every_n_train_steps: int | None = None) -> None:
        if not factor > 1:
            raise UserError(f"callbacks.divergence.factor={factor}: give a number above 1 (default 1000).")
        if not 0 <= ema_decay < 1:
            raise UserError(f"callbacks.divergence.ema_decay={ema_decay}: give a number in [0, 1).")
        self.factor, self.floor, self.warmup_steps, self.ema_decay = factor, floor, warmup_steps, ema_decay
        self.every_n = every_n_train_steps
        self.level: float | None = None
        self.seen = 0
        self.good_step: int | None = None
        self.candidate_step: int | None = None
        self.dirpath: Path | None = None
        self.diverged = False
        self.started = time.time()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        ckpt = trainer.checkpoint_callback
        self.dirpath = Path(ckpt.dirpath) if ckpt is not None and ckpt.dirpath else None
        if self.every_n is None and ckpt is not None:
            self.every_n = getattr(ckpt, "_every_n_train_steps", 0) or None
        self.started = time.time()
        if trainer.ckpt_path and self.dirpath is not None and (self.dirpath / LAST_GOOD).is_file():
            # A resumed run: the good checkpoint of the earlier run stays good until this one saves a newer one.
            # (A fresh run in the same directory does not point at an earlier run's good checkpoint.)
            self.good_step = _ckpt_step(self.dirpath / LAST_GOOD)

    # -- the checks ------------------------------------------------------------------------------------------------
    def _fail(self, trainer: L.Trainer, what: str, cls: type[UserError] = DivergenceError) -> None:
        raise cls(f"training diverged at step {trainer.global_step}: {what}. {last_good_advice(trainer)}")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """After a divergence (raised here or by the module's own loss check), `last.ckpt` may hold diverged
        weights: move it aside, so `ckpt_path=last` cannot resume from it."""
        if not isinstance(exception, (DivergenceError, NonFiniteLossError)):
            return
        self.diverged = True
        if trainer.is_global_zero and self.dirpath is not None:
            ckpt = trainer.checkpoint_callback
            for last in {self.dirpath / "last.ckpt", Path(getattr(ckpt, "last_model_path", "") or self.dirpath)}:
                if last.is_file() and last.stat().st_mtime >= self.started:  # written by this run, after its start
                    os.replace(last, self.dirpath / DIVERGED)
            (self.dirpath / CANDIDATE).unlink(missing_ok=True)

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "seen": self.seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.level, self.seen = state_dict.get("level"), int(state_dict.get("seen", 0))

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        value = float(loss.detach())
        if not math.isfinite(value):
            self._fail(trainer, f"the training loss is {value}", NonFiniteLossError)
        if self.level is not None and self.seen >= self.warmup_steps:
            limit = self.factor * max(self.level, self.floor)
            if value > limit:
                self._fail(trainer, f"the training loss {value:.4g} is above {self.factor:g} x its running level "
                                    f"{self.level:.4g} (callbacks.divergence.factor)")
        # The loss was computed with the current weights: a candidate saved with them is good.
        self._promote(trainer)
        self.level = value if self.level is None else self.ema_decay * self.level + (1 - self.ema_decay) * value
        self.seen += 1

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            if not torch.isfinite(norm):
                self._fail(trainer, f"the gradient norm is {norm.item()}")
        bad = [n for n, p in pl_module.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
        if bad:
            self._fail(trainer, f"non-finite weights in {bad[:3]}")

    # -- the good checkpoint ---------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.dirpath is None or not self.every_n or step % self.every_n or step == self.candidate_step:
            return
        trainer.save_checkpoint(self.dirpath / CANDIDATE, weights_only=False)
        self.candidate_step = step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.dirpath is not None:
            (self.dirpath / CANDIDATE).unlink(missing_ok=True)  # never checked by a later loss: not known good

    def _promote(self, trainer: L.Trainer) -> None:
        if self.candidate_step is None or self.candidate_step != trainer.global_step or self.dirpath is None:
            return
        if trainer.is_global_zero and (self.dirpath / CANDIDATE).is_file():
            os.replace(self.dirpath / CANDIDATE, self.dirpath / LAST_GOOD)
            self.good_step = self.candidate_step
        self.candidate_step = None


class RestoreLoaderPosition(Callback):
    """Restore the training dataloader's position from the checkpoint being resumed.

    Lightning loads a stateful dataloader's `state_dict` when it first builds the training loader, but
    `trainer.estimated_stepping_batches` (which the LR schedule reads in `configure_optimizers`) builds it before
    the checkpoint is read, and the position is then silently dropped (Lightning issue #20550). This loads the
    pending position at the start of training and restarts the loader's iterator from it, as the normal path
    would have. Without a pending position (a fresh run, or a fixed Lightning) it does nothing.
    """

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loop = trainer.fit_loop
        if not getattr(loop, "_combined_loader_states_to_load", None) or getattr(loop, "_data_fetcher", None) is None:
            return
        loop._load_combined_loader_states()
        iter(loop._data_fetcher)  # the iterator made before the restore holds the old position


class CheckpointOnMaxSteps(Callback):
    """Save `last.ckpt` from inside the step that reaches `trainer.max_steps`.

    A checkpoint saved after `fit` returns counts a partial epoch as completed and holds no dataloader position,
    so a run stopped by `max_steps` mid-epoch and resumed with a larger one would start the next epoch and skip
    the rest of this one. Saved here, the state is the one a periodic checkpoint would hold at this step, and
    the resumed run continues the same epoch at the next batch. (Runs that stop on `max_epochs` end at an epoch
    boundary; train.py saves those after `fit`.)
    """

    def __init__(self, dirpath: str | os.PathLike) -> None:
        self.dirpath = Path(dirpath)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not trainer.fast_dev_run and 0 < trainer.max_steps <= trainer.global_step:
            trainer.save_checkpoint(self.dirpath / "last.ckpt", weights_only=False)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, with the temporary file beside its destination: the checkpoint is written to
    `<dir>/.<name>.<pid>.tmp`, fsynced, and renamed over the old file (os.replace, atomic within a filesystem).

    Lightning's own writer puts the temporary file in the system temp directory and moves it into place; when that
    directory is on another disk the move is a copy over the old file, and a full disk left a truncated `last.ckpt`
    where the good one had been. Here a failed write loses only the new checkpoint. train.py gives every trainer
    one, so every save (ModelCheckpoint, the divergence guard's candidate, `last.ckpt` at the end) goes through it.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's own transaction
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)  # serialised before any file is touched
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                self._write(f, buffer.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            tmp.unlink(missing_ok=True)  # frees what the partial write took
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise UserError(f"checkpoint {str(path)!r} could not be written ({e.strerror}); the previous "
                                f"{path.name} is kept. Free space in {str(path.parent)!r}, then resume with "
                                f"ckpt_path=last.") from e
            raise
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a power cut
        finally:
            os.close(fd)

    def _write(self, f: Any, data: memoryview) -> None:
        """Write the serialised checkpoint to the open temporary file (one place a disk-full fault can strike)."""
        f.write(data)


def _ckpt_step(path: Path) -> int | None:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True).get("global_step"))
    except Exception:  # only for the message; a bad file is reported when it is resumed from
        return None


# -- before a run starts ----------------------------------------------------------------------------------------------
def check_writable(directory: str | os.PathLike, what: str) -> None:
    """Create `directory` if needed and write a file in it; a UserError naming `what` if that fails."""
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UserError(f"{what} {str(path)!r} cannot be written ({e.strerror or e}). Make it writable, or "
                        f"choose another place (name=..., or hydra.run.dir=...).") from e


class RunLock:
    """An exclusive lock on a run directory (fcntl.flock on `<dir>/.lock`), so two runs with one `name` cannot
    write the same checkpoints and export. The OS releases it when the holder dies, so a stale lock never blocks.
    Under DDP only the primary process takes it: the ranks it launches are the same run."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory).expanduser() / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        from runtime.distributed import is_primary

        if not is_primary():  # a rank started by the primary process (DDP), which holds the lock for the run
            return self
        check_writable(self.path.parent, "the run directory")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"another training run (pid {holder}) is using {str(self.path.parent)!r}. Wait for it "
                            f"to finish, or give this run another name (name=...).") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


class WritableRunDir(HydraCallback):
    """Hydra creates the run directory before train.py's code runs; check it first, so a run directory that cannot
    be written is one message (exit status 2), not Hydra's traceback."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        # The default `name` reads ${hydra:runtime.choices...}: resolvable once the config is Hydra's current one (as
        # Hydra itself sets it next, before making the directory).
        HydraConfig.instance().set_config(config)
        exit_on_user_error(lambda: check_writable(config.hydra.run.dir, "the run directory"))

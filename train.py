"""Train a drafter for a frozen verifier, then export it.

    python train.py model=medusa                 # the default verifier, self-distilled data, W&B offline
    python train.py experiment=smoke             # two minutes end to end
    python train.py ckpt_path=last               # resume the run named `name`

compose -> check the settings -> lock the run directory, refuse a resume that would train another run than the one
recorded (train/resume.py) and a new run over a finished one of the same name (unless overwrite=true), record the
config in .hydra/, check checkpoint/export locations -> instantiate verifier, data, model, logger, callbacks, trainer
-> fit (a divergence guard keeps checkpoints/last-good.ckpt; checkpoints are renamed into place; Ctrl-C prints the
command that resumes) -> export (printed last).
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from models.exports.io import load_export
from runtime.cpu_memory import bound_onednn_cache, keep_freed_memory
from runtime.distributed import is_primary
from runtime.errors import UserError, exit_on_user_error
from train.distributed import RanksAgree
from train.memory import plan_memory
from train.preflight import check_reused_name, check_settings, record_run_config
from train.resume import check_resume, resume_command
from train.safety import (
    LAST_GOOD,
    AtomicCheckpointIO,
    CheckpointOnMaxSteps,
    RestoreLoaderPosition,
    RunLock,
    check_writable,
)


def resolve_ckpt(cfg: DictConfig) -> str | None:
    """`ckpt_path=last` means this run's own last checkpoint; anything else is a path (or null). The file is read
    once here with torch.load(weights_only=True), so a truncated or unsafe checkpoint stops before any work."""
    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path == "last":
        checkpoints = Path(cfg.output_dir) / "checkpoints"
        path = checkpoints / "last.ckpt"
        if not path.is_file():
            good = checkpoints / LAST_GOOD
            hint = (f"The run diverged earlier and kept its last good checkpoint: resume with ckpt_path={good}."
                    if good.is_file() else f"Resume with the same `name` as the run you are resuming "
                    f"(name={cfg.name!r} now), or pass ckpt_path=<file.ckpt>.")
            raise UserError(f"ckpt_path=last: no checkpoint at {path}. {hint}")
    elif not Path(cfg.ckpt_path).is_file():
        raise UserError(f"ckpt_path={cfg.ckpt_path!r} does not exist. Pass a .ckpt file, `last`, or null.")
    else:
        path = Path(cfg.ckpt_path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, objects other than tensors and plain values
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {str(path)!r} cannot be loaded safely ({type(e).__name__}: {first[:300]}). "
                        f"It is truncated, damaged, or holds objects other than tensors and plain values. Resume "
                        f"from another checkpoint (checkpoints/{LAST_GOOD} if the run has one), or start again "
                        f"with ckpt_path=null.") from e
    if not isinstance(state, dict) or "state_dict" not in state:
        raise UserError(f"checkpoint {str(path)!r} is not a Lightning checkpoint (no state_dict). Pass a .ckpt "
                        f"written by train.py, `last`, or null.")
    return str(path)


def check_output_locations(cfg: DictConfig) -> None:
    """Refuse to start when the checkpoints directory or the export location cannot be written."""
    if cfg.callbacks.get("checkpoint") is not None:
        check_writable(cfg.callbacks.checkpoint.dirpath, "the checkpoints directory")
    if cfg.callbacks.get("export") is not None:
        check_writable(Path(cfg.callbacks.export.dirpath).expanduser().parent, "the export location")


def interrupted(cfg: DictConfig, trainer: L.Trainer) -> str:
    """What a run stopped by Ctrl-C says: the checkpoint it keeps and the command that resumes it."""
    last = Path(cfg.callbacks.checkpoint.dirpath) / "last.ckpt" if cfg.callbacks.get("checkpoint") else None
    if last is None or not last.is_file():
        return (f"interrupted at step {trainer.global_step}, before the first checkpoint: nothing to resume. Run "
                f"the same command again to start over.")
    step = torch.load(last, map_location="cpu", weights_only=True).get("global_step")
    return (f"interrupted at step {trainer.global_step}; {last} keeps step {step}. Resume with:\n"
            f"  {resume_command(cfg)}")


def run(cfg: DictConfig) -> Path:
    """Fit the drafter described by `cfg`; returns the export directory. Holds a lock on the run directory."""
    check_settings(cfg)  # before anything is written or loaded
    with RunLock(cfg.output_dir):
        ckpt_path = resolve_ckpt(cfg)
        if is_primary():  # the ranks a DDP run launches are this run
            check_resume(cfg, ckpt_path)  # a resume that would train another run: refused with the run's recipe kept
            check_reused_name(cfg)
            record_run_config(cfg)  # only now: a run refused above leaves the running one's recipe as it was
        return _run(cfg, ckpt_path)


def _run(cfg: DictConfig, ckpt_path: str | None) -> Path:
    if cfg.get("keep_freed_memory", True):
        keep_freed_memory()
    bound_onednn_cache()  # before the first tensor work: a step's changing shapes would fill oneDNN's cache
    L.seed_everything(cfg.seed, workers=True)
    check_output_locations(cfg)
    verifier = instantiate(cfg.verifier)
    datamodule = instantiate(cfg.data, verifier=verifier)
    model = instantiate(cfg.model, verifier=verifier)
    datamodule.hidden_layers = model.hidden_layers  # which hidden states offline mode caches
    datamodule.verifier_argmax = getattr(model, "uses_verifier_argmax", False)  # and M_q's argmax beside them
    if cfg.get("init_from"):
        model.warm_start(load_export(cfg.init_from, verifier), cfg.init_from)  # checked against the verifier
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [instantiate(c) for c in cfg.callbacks.values()] + [RestoreLoaderPosition(), RanksAgree(cfg)]
    if cfg.callbacks.get("checkpoint") is not None:
        callbacks.append(CheckpointOnMaxSteps(cfg.callbacks.checkpoint.dirpath))  # a mid-epoch stop resumes mid-epoch
    # Every checkpoint is written beside its destination and renamed over it: a full disk keeps the previous one.
    trainer: L.Trainer = instantiate(cfg.trainer, logger=logger, callbacks=callbacks, plugins=[AtomicCheckpointIO()])
    if is_primary():  # what the run will hold per process, before it starts (train/memory.py)
        print(plan_memory(verifier, model, cfg.data.batch_size, cfg.data.max_length, world=trainer.world_size,
                          shard_verifier="shard_verifier" in cfg.callbacks,
                          offline=bool(cfg.data.get("cache_hidden_states")),
                          precision=str(cfg.trainer.get("precision"))).table())
    if logger:
        logger.log_hyperparams({**OmegaConf.to_container(cfg, resolve=True),
                                "verifier_fingerprint": verifier.fingerprint})
    # Resuming loads tensors and plain values only (resolve_ckpt has already read the file so, for older Lightning).
    safe = {"weights_only": True} if "weights_only" in inspect.signature(trainer.fit).parameters else {}
    if cfg.get("validate_only"):
        return revalidate(cfg, trainer, model, datamodule, ckpt_path, safe)
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **safe)
    except SystemExit:  # Lightning's answer to Ctrl-C (SIGINT): a graceful stop, then sys.exit(1)
        if trainer.interrupted and is_primary():
            print(interrupted(cfg, trainer), file=sys.stderr, flush=True)
        raise
    if trainer.checkpoint_callback is not None and not trainer.fast_dev_run:
        # ModelCheckpoint saves every N steps; also keep the final state, so `ckpt_path=last` with a larger
        # max_epochs / max_steps continues from where this run ended. A run stopped by max_steps has it already
        # (CheckpointOnMaxSteps, saved inside the epoch); one stopped by max_epochs is saved here.
        last = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
        if not 0 < trainer.max_steps <= trainer.global_step:
            trainer.save_checkpoint(last, weights_only=False)
        if trainer.is_global_zero and not last.is_file():
            raise UserError(f"training finished but {last} was not written: check that {last.parent} is writable "
                            f"and has free space. The export is at {cfg.callbacks.export.dirpath}.")
    if logger and hasattr(logger, "experiment") and hasattr(logger.experiment, "finish"):
        logger.experiment.finish()
    return Path(cfg.callbacks.export.dirpath)


def revalidate(cfg: DictConfig, trainer: L.Trainer, model: L.LightningModule, datamodule: L.LightningDataModule,
               ckpt_path: str | None, safe: dict) -> Path:
    """`validate_only=true`: validate the checkpoint on the run's held-out split and write the export again from it,
    so it carries the validation figures this train.py records. Figures only training measures (the last epoch's
    training accuracy) come from the checkpoint, or, for one written before checkpoints kept them, from the previous
    export of the same run (same trained_steps)."""
    trainer.validate(model, datamodule=datamodule, ckpt_path=ckpt_path, **safe)
    dirpath = Path(cfg.callbacks.export.dirpath)
    previous = dirpath / "config.json"
    old = json.loads(previous.read_text()) if previous.is_file() else {}
    if old.get("trained_steps") == model.trained_steps:
        if not model.train_summary and "train_depth1_top1" in old:
            model.train_summary = {"train_depth1_top1": old["train_depth1_top1"]}
        if getattr(model, "draft_vocab_coverage", 0) is None:  # EAGLE-3's is counted when training starts
            model.draft_vocab_coverage = old.get("draft_vocab_coverage")
    if trainer.is_global_zero:
        model.export(dirpath)
    return dirpath


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    export = exit_on_user_error(lambda: run(cfg))
    if is_primary():  # under DDP every rank runs main(); the run's export is said once
        print(f"export: {export}")


if __name__ == "__main__":
    main()

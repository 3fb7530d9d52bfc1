"""Train a drafter for a frozen verifier, then export it.

    python train.py model=medusa                 # the default verifier, self-distilled data, W&B offline
    python train.py experiment=smoke             # two minutes end to end
    python train.py ckpt_path=last               # resume the run named `name`

compose -> instantiate verifier, data, model, logger, callbacks, trainer -> fit -> export (printed last).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from models.errors import UserError, exit_on_user_error


def resolve_ckpt(cfg: DictConfig) -> str | None:
    """`ckpt_path=last` means this run's own last checkpoint; anything else is a path (or null)."""
    if cfg.ckpt_path in (None, "last"):
        path = Path(cfg.output_dir) / "checkpoints" / "last.ckpt"
        if cfg.ckpt_path == "last" and not path.is_file():
            raise UserError(f"ckpt_path=last: no checkpoint at {path}. Resume with the same `name` as the run "
                            f"you are resuming (name={cfg.name!r} now), or pass ckpt_path=<file.ckpt>.")
        return str(path) if cfg.ckpt_path else None
    if not Path(cfg.ckpt_path).is_file():
        raise UserError(f"ckpt_path={cfg.ckpt_path!r} does not exist. Pass a .ckpt file, `last`, or null.")
    return str(cfg.ckpt_path)


def run(cfg: DictConfig) -> Path:
    """Fit the drafter described by `cfg`; returns the export directory."""
    L.seed_everything(cfg.seed, workers=True)
    ckpt_path = resolve_ckpt(cfg)
    verifier = instantiate(cfg.verifier)
    datamodule = instantiate(cfg.data, verifier=verifier)
    model = instantiate(cfg.model, verifier=verifier)
    datamodule.hidden_layers = model.hidden_layers  # which hidden states offline mode caches
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    trainer: L.Trainer = instantiate(cfg.trainer, logger=logger, callbacks=callbacks)
    if logger:
        logger.log_hyperparams({**OmegaConf.to_container(cfg, resolve=True), "verifier_fingerprint": verifier.fingerprint})
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    if trainer.checkpoint_callback is not None and not trainer.fast_dev_run:
        # ModelCheckpoint saves every N steps; also keep the final state, so `ckpt_path=last` with a larger
        # max_epochs / max_steps continues from where this run ended.
        trainer.save_checkpoint(Path(cfg.output_dir) / "checkpoints" / "last.ckpt")
    if logger and hasattr(logger, "experiment") and hasattr(logger.experiment, "finish"):
        logger.experiment.finish()
    return Path(cfg.callbacks.export.dirpath)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    export = exit_on_user_error(lambda: run(cfg))
    print(f"export: {export}")


if __name__ == "__main__":
    main()

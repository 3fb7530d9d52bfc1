"""Loggers: W&B offline unless the user has configured an account; CSV as a dependency-free alternative."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger

from runtime.wandb_mode import wandb_mode


def wandb_logger(save_dir: str, project: str, name: str | None = None, mode: str | None = None,
                 **kwargs: Any) -> WandbLogger:
    """A WandbLogger whose run directory is `<save_dir>/wandb/`, in the mode `runtime.wandb_mode.wandb_mode` picks."""
    mode = wandb_mode(mode)
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(save_dir=save_dir, project=project, name=name, offline=(mode == "offline"), mode=mode, **kwargs)

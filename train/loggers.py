"""Loggers: W&B offline unless the user has configured an account; CSV as a dependency-free alternative."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger


def wandb_configured() -> bool:
    """True when the user has W&B credentials (an API key in the environment or in ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_logger(save_dir: str, project: str, name: str | None = None, mode: str | None = None, **kwargs: Any) -> WandbLogger:
    """A WandbLogger whose run directory is `<save_dir>/wandb/`.

    `mode` (online / offline / disabled) wins if given, then $WANDB_MODE, then: online with credentials, else offline.
    """
    mode = mode or os.environ.get("WANDB_MODE") or ("online" if wandb_configured() else "offline")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(save_dir=save_dir, project=project, name=name, offline=(mode == "offline"), mode=mode, **kwargs)

"""The W&B mode rule, one for training and evaluation: offline unless the user has configured an account."""

from __future__ import annotations

import netrc
import os


def wandb_configured() -> bool:
    """True when the user has W&B credentials (an API key in the environment or in ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_mode(mode: str | None = None) -> str:
    """`mode` (online / offline / disabled) if given, then $WANDB_MODE, then online with credentials, else offline."""
    return str(mode or os.environ.get("WANDB_MODE") or ("online" if wandb_configured() else "offline"))

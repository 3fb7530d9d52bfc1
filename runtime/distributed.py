"""Several processes, torch.distributed only: which one this is before Lightning sets up its process group, its
rank and world once it has, barriers, and the checks that every rank holds the same thing. The Lightning callbacks
built on them are in train/distributed.py.

`python train.py trainer=ddp trainer.devices=N` starts one process; at `trainer.fit` Lightning's launcher starts
ranks 1..N-1 as copies of the same command line (with LOCAL_RANK set), and torchrun or SLURM start every rank with
RANK set. Work that must happen once per run (the run-directory lock, the export) belongs to the primary process:
global rank 0, or the process that has not been launched as a rank yet.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch.distributed as dist
from torch import Tensor

from runtime.errors import UserError


def launched_rank() -> int:
    """This process's global rank as its launcher set it in the environment (0 when none did)."""
    if os.environ.get("RANK") is not None:
        return int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    return local if int(os.environ.get("NODE_RANK", 0)) == 0 else local + 1  # any non-zero node is not primary


def is_primary() -> bool:
    return launched_rank() == 0


def digest(value: Any) -> str:
    """A short sha256 of a JSON-able value (sorted keys), to compare across ranks."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_ranks_agree(what: str, value: str, fix: str) -> None:
    """Raise on every rank when the ranks' `value` (a digest) differ: all-gathered, so none waits forever for a
    rank that stopped. A no-op outside a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    values: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) > 1:
        ranks = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise UserError(f"the ranks disagree on {what} ({ranks}). {fix}")


def world() -> tuple[int, int]:
    """(rank, world size) of the process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def token_share(tokens: Tensor) -> Tensor | float:
    """W * n_r / sum over ranks of n (n: this rank's target count this step); 1.0 in one process or when no rank
    has a target."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1.0
    local = tokens.detach().float().reshape(1)
    total = local.clone()
    dist.all_reduce(total)
    return (dist.get_world_size() * local / total.clamp(min=1)).squeeze(0) if float(total) > 0 else 1.0


"""Several processes: which one this is before Lightning sets up its process group, and the checks that every rank
trains on the same thing.

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

import datasets
import lightning as L
import numpy as np
import pyarrow.compute as pc
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from models.errors import UserError


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


def all_true(flag: bool) -> bool:
    """Whether `flag` holds on every rank (one all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([0 if flag else 1])
    dist.all_reduce(t)
    return int(t) == 0


def token_share(tokens: Tensor) -> Tensor | float:
    """W * n_r / sum over ranks of n (n: this rank's target count this step); 1.0 in one process or when no rank
    has a target."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1.0
    local = tokens.detach().float().reshape(1)
    total = local.clone()
    dist.all_reduce(total)
    return (dist.get_world_size() * local / total.clamp(min=1)).squeeze(0) if float(total) > 0 else 1.0


class RanksAgree(Callback):
    """At setup, once the process group is up: every rank must have composed the same config (its resolved values,
    the run directory aside) and read the same training and validation rows. Otherwise one message on every rank,
    before any step (nothing is written)."""

    def __init__(self, cfg: DictConfig) -> None:
        values = OmegaConf.to_container(cfg, resolve=True)
        for key in ("output_dir",):
            values.pop(key, None)
        self.config = digest(values)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_ranks_agree("the run's config", self.config,
                          "Start every rank with the same command line, config files and environment.")
        dm = getattr(trainer, "datamodule", None)
        rows = [getattr(dm, name, None) for name in ("train_set", "val_set")]
        if all(r is not None for r in rows):
            check_ranks_agree("the training data", data_digest(*rows),
                              "Every rank must read the same data: the same data.* settings and the same files "
                              "(a shared cache_dir, or identical copies).")


def data_digest(*sets: datasets.Dataset) -> str:
    """sha256 over every row's token ids and loss mask, in order."""
    h = hashlib.sha256()
    for ds in sets:
        table = ds.with_format("arrow")[:]
        for name in ("input_ids", "loss_mask"):
            column = table.column(name).combine_chunks()
            h.update(str(len(column)).encode())
            h.update(np.asarray(column.flatten()).tobytes())  # flatten() respects a slice, .values does not
            h.update(np.asarray(pc.list_value_length(column)).tobytes())
    return h.hexdigest()[:16]


class ShardVerifier(Callback):
    """trainer=fsdp: the frozen verifier's decoder layers sharded over the ranks with FSDP2 (`fully_shard`, one
    unit per layer, resharded after each forward), the drafter trained as usual (DDP: it is small). Each rank keeps
    1/W of the decoder layers and gathers a layer's weights only while it runs; the embeddings, the final norm and
    the lm_head stay whole on every rank, because every drafter reads the head (and EAGLE the embeddings) directly.
    Every rank runs the verifier in lockstep (one forward per batch; validation batches are padded to equal counts).
    The verifier is loaded whole on each rank before it is sharded: host memory must hold it once per process."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        verifier = pl_module.verifier
        device = trainer.strategy.root_device
        if trainer.world_size == 1:
            print("[fsdp] one process: the verifier is not sharded")
            return
        verifier.to(device)
        mesh = init_device_mesh(device.type, (trainer.world_size,))
        decoder = verifier.model.get_decoder()
        for layer in decoder.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        if trainer.is_global_zero:
            print(f"[fsdp] {len(decoder.layers)} verifier decoder layers sharded over {trainer.world_size} ranks "
                  f"({device.type}); embeddings, norm and head whole on every rank")

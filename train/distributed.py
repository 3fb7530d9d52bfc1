"""Several processes in a Lightning run (trainer=ddp, trainer=fsdp): the callbacks that check every rank trains on the
same config and data, and that shard the frozen verifier. The torch.distributed helpers are runtime/distributed.py.
"""

from __future__ import annotations

import hashlib

import datasets
import lightning as L
import numpy as np
import pyarrow.compute as pc
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

from runtime.distributed import check_ranks_agree, digest


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

"""The training sampler: an order that is a function of (seed, epoch), so a run resumed mid-epoch replays it.

Lightning saves the training dataloader's `state_dict` in every checkpoint when the loader has one
(torchdata's `StatefulDataLoader`, which asks its sampler for its own state). `EpochSampler` keeps what the order
cannot recompute: the epoch and how many indices it has handed out. A resumed run rebuilds the same permutation
from `seed + epoch` and skips what the killed run had already trained on, without loading those rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from runtime.errors import UserError


class EpochSampler(DistributedSampler):
    """A shuffled order per epoch, optionally grouped by length, resumable at any index.

    Args:
        dataset: anything with a length.
        seed: the order of epoch e is drawn from `seed + e` (DistributedSampler's rule), not from a global RNG.
        lengths: with `batch_size`, group by length (transformers' `get_length_grouped_indices`: random
            megabatches of 50 batches, each sorted longest first), so a batch pads little.
        batch_size: the per-process batch size (grouping spans all processes' batches).

    It is a DistributedSampler, so Lightning leaves it in place under DDP; the process count and rank come from
    `torch.distributed` when a process group is up, else 1 and 0.
    """

    def __init__(self, dataset: Sequence, seed: int = 0, lengths: Sequence[int] | None = None,
                 batch_size: int = 1) -> None:
        replicas, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() \
            else (1, 0)
        super().__init__(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        if lengths is not None and len(lengths) != len(dataset):
            raise ValueError(f"lengths has {len(lengths)} entries for {len(dataset)} rows")
        self.lengths = None if lengths is None else list(lengths)
        self.batch_size = batch_size
        self.yielded = 0  # indices handed out in the current epoch
        self._resume_epoch: int | None = None  # a restored position, applied to that epoch only
        self._resume_at = 0

    def order(self, epoch: int) -> list[int]:
        """This process's indices for `epoch`: the whole epoch's order, padded to divide evenly, then strided."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        if self.lengths is None:
            indices = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            indices = get_length_grouped_indices(self.lengths, self.batch_size * self.num_replicas,
                                                 generator=generator)
        if len(indices) < self.total_size:  # DistributedSampler's padding: repeat from the start
            indices += (indices * (self.total_size // max(len(indices), 1) + 1))[: self.total_size - len(indices)]
        return indices[self.rank: self.total_size: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        start = self._resume_at if self._resume_epoch == self.epoch else 0
        self._resume_epoch, self._resume_at = None, 0
        self.yielded = start
        for index in self.order(self.epoch)[start:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "yielded": self.yielded, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_samples") != self.num_samples or state.get("seed") != self.seed:
            raise UserError(f"the checkpoint's training order was for {state.get('num_samples')} rows per process "
                             f"and seed {state.get('seed')}; this run has {self.num_samples} and seed {self.seed}. "
                             f"Resume with the same data settings, or start again with ckpt_path=null.")
        self.epoch = self._resume_epoch = int(state["epoch"])
        self._resume_at = self.yielded = int(state["yielded"])

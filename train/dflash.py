"""DFlashModule: trains a DFlash drafter (models/dflash.py) on the frozen verifier's features.

The loss and the tables are EAGLE-1's (train/eagle.py), which drafts through the verifier's own head as DFlash does:
per slot k, the cross-entropy to q at the position before its target (soft targets, through the frozen head, fused
and chunked), weighted decay^(k-1) (`step_decay`, exp(-1/4) as the paper sets it for blocks of 8), no feature
regression; `model.train_vocab=N` trains over the N most frequent targets' rows of the head (FR-Spec) as it does for
EAGLE-1. Validation logs each slot's top-1, the estimated tau and the per-slot top-k table tree planning reads. The
forward is `models.dflash.block_rows`: sampled anchors, each block of [root, masks] attending its context.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from models.dflash import block_rows, build_dflash
from models.verifier import Verifier
from train.eagle import EagleModule


class DFlashModule(EagleModule):
    """Args (beyond the optimiser's):
        mask_token_id: the token of every mask slot (SmolLM2: 16, `<empty_output>`; training refuses one the data
            holds as a target).
        block_size: the root and its K = block_size - 1 drafts (vLLM's speculative tokens for the export).
        num_layers: draft layers.
        aux_layer_ids: the verifier layers fused into the context (ids as EAGLE-3's: the input of layer k).
        num_anchors: blocks per sequence in a training step (validation: every anchor).
        step_decay: slot k's loss weight is step_decay^(k-1) (default exp(-1/4)).
        train_vocab: as EAGLE-1's.
    """

    def __init__(self, verifier: Verifier, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, mask_token_id: int = 16, block_size: int = 8,
                 num_layers: int = 1, aux_layer_ids: list[int] | None = None, num_anchors: int | None = 64,
                 step_decay: float = math.exp(-0.25), warmup_ratio: float = 0.05,
                 train_vocab: int | None = None) -> None:
        net = build_dflash(verifier, mask_token_id, block_size, num_layers, aux_layer_ids)
        # kind="eagle": EAGLE-1's loss path, through the verifier's own head
        super().__init__(verifier, optimizer, scheduler, kind="eagle", ttt_steps=net.parallel,
                         val_steps=net.parallel, step_decay=step_decay, feature_weight=0.0, ce_weight=1.0, noise=0.0,
                         warmup_ratio=warmup_ratio, train_vocab=train_vocab, net=net)
        self.hparams.update(mask_token_id=mask_token_id, block_size=block_size, num_layers=num_layers,
                            aux_layer_ids=aux_layer_ids, num_anchors=num_anchors)

    def unrolled(self, feats: Tensor, ids: Tensor, attn: Tensor, loss_mask: Tensor, embed: torch.nn.Module,
                 steps: int, train: bool):
        return block_rows(self.net, feats, ids, attn, loss_mask, embed, steps,
                          self.hparams.num_anchors if train else None)

"""PEagleModule: trains a P-EAGLE drafter (models/peagle.py) on the frozen verifier's features.

Everything but the forward is every verifier-fed drafter's (train/verifier_fed.py), as EAGLE-3 trains: the draft
vocabulary, the targets (q restricted to it, from the argmax cache offline), the soft-target cross-entropy per depth,
validation's per-depth top-1, estimated tau and top-k table (which tree planning reads), and the export. The forward
is `models.peagle.parallel_rows`: step 0 over every position, then COD-sampled mask slots for depths 1..K-1 in one
forward (validation: every chain).
Every depth weighs the same by default (`step_decay` 1.0), as the published recipe's loss does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from models.peagle import build_peagle, parallel_rows
from models.verifiers.core import Verifier
from runtime.errors import UserError
from train.verifier_fed import VerifierFedModule


class PEagleModule(VerifierFedModule):
    """Args (beyond VerifierFedModule's; `ttt_steps` and `val_steps` are `parallel_tokens` here):
        mask_token_id: the token of every mask slot (one the data never holds; SmolLM2: 16, `<empty_output>`).
        parallel_tokens: K, the tokens one drafter forward drafts (vLLM's speculative tokens for the export).
        cod_ratio, cod_min_ratio: depth d trains a share max(ratio^d, min_ratio) of the chains (COD sampling).
        max_anchors: at most this many chains per sequence at depth 1 (bounds a step's mask slots).
        draft_vocab_size, aux_layer_ids, fc_norm: EAGLE-3's (train/eagle.py).
        loss, lk_eta: the loss per depth (train/losses.py), as VerifierFedModule's.
    """

    def __init__(self, verifier: Verifier, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, mask_token_id: int = 16, parallel_tokens: int = 4,
                 cod_ratio: float = 0.7, cod_min_ratio: float = 0.2, max_anchors: int | None = 256,
                 step_decay: float = 1.0, draft_vocab_size: int | None = None,
                 aux_layer_ids: list[int] | None = None, warmup_ratio: float = 0.05, fc_norm: bool = False,
                 loss: str = "kl", lk_eta: float = 3.0) -> None:
        for name, value in (("cod_ratio", cod_ratio), ("cod_min_ratio", cod_min_ratio)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise UserError(f"model.{name}={value!r}: give a share in (0, 1] (defaults 0.7 and 0.2).")
        net = build_peagle(verifier, mask_token_id, parallel_tokens, draft_vocab_size, aux_layer_ids, fc_norm)
        super().__init__(verifier, optimizer, scheduler, net, ttt_steps=parallel_tokens, val_steps=parallel_tokens,
                         step_decay=step_decay, warmup_ratio=warmup_ratio, loss=loss, lk_eta=lk_eta)
        self.hparams.update(mask_token_id=mask_token_id, parallel_tokens=parallel_tokens, cod_ratio=cod_ratio,
                            cod_min_ratio=cod_min_ratio, max_anchors=max_anchors, fc_norm=fc_norm)

    def unrolled(self, feats: Tensor, ids: Tensor, attn: Tensor, loss_mask: Tensor, embed: torch.nn.Module,
                 steps: int, train: bool):
        hp = self.hparams
        if train:
            return parallel_rows(self.net, feats, ids, attn, loss_mask, embed, steps, hp.cod_ratio,
                                 hp.cod_min_ratio, hp.max_anchors)
        return parallel_rows(self.net, feats, ids, attn, loss_mask, embed, steps, 1.0, 1.0, None)

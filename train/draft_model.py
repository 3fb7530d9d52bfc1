"""DraftModelModule: distils a truncated copy of the verifier into an independent draft model M_p.

The draft is the verifier's first k decoder layers and its final norm, as its own float32 copies (trainable), over the
verifier's frozen embeddings, rotary table and lm_head (models.draft_model.truncate). It runs its own forward over
the input ids, as it will at decode time; the verifier's next-token distribution q at the same positions comes from
its final-normed last hidden state through lm_head (one frozen forward, or offline mode's cache).

Loss = KL(q || p) = sum_x q(x) (log q(x) - log p(x)), averaged over positions t whose next token t+1 is an assistant
token; `model.loss` picks another acceptance loss (train/losses.py: kl, rkl, jsd, ce, tv, nla, lk_hybrid), computed
fused and chunked. Logged: train/loss, train/top1 (argmax p == argmax q), val/kl and val/top1 over the held-out
sequences (token-weighted), and val/expected_accepted_length: 1 + sum_{k=1..val_steps} prod_{j<k} alpha_{t+j},
alpha = sum_v min(p_v, q_v) at the positions after t, teacher-forced on the data's continuation (the verifier's own
tokens, as accepted drafts are distributed), over positions t with a target. Export: a plain HF checkpoint with the
verifier fingerprint (models.draft_model).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data.hidden_cache import gather_layers
from models.draft_model import save_draft_model, truncate
from models.verifiers.core import Verifier
from runtime.errors import NonFiniteLossError, UserError
from train.base import DrafterModule
from train.export import data_record
from train.losses import chain_acceptance, check_eta, check_loss, chunked_loss
from train.memory import layer_activations
from train.safety import last_good_advice


def next_token_positions(loss_mask: Tensor) -> Tensor:
    """Positions t whose next token t+1 is an assistant token: where p and q are compared. (B, T) bool"""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = loss_mask[:, 1:].bool()
    return valid


def kl_and_agreement(q_logits: Tensor, p_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per-position KL(q || p) (N,) and whether the two argmaxes agree (N,), from (N, V) logits."""
    log_q, log_p = F.log_softmax(q_logits.float(), dim=-1), F.log_softmax(p_logits.float(), dim=-1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    return kl, q_logits.argmax(-1) == p_logits.argmax(-1)


class DraftModelModule(DrafterModule):
    """Args:
        verifier: the frozen M_q, held by reference (never in checkpoints or hyperparameters).
        optimizer: partial torch optimizer (`_partial_: true`).
        scheduler: partial LR schedule taking (optimizer, num_warmup_steps, num_training_steps), or None.
        warmup_ratio: fraction of the optimisation steps spent in linear warmup.
        num_layers: k, the verifier layers the draft keeps (its first k).
        loss: what training minimises between p and q (train/losses.py); kl by default.
        lk_eta: lk_hybrid's eta.
        val_steps: the chain depth validation's expected accepted length counts (drafts per round).
    """

    hidden_layers = [-1]  # verifier hidden states training reads: the final-normed last layer (the lm_head input)

    def activation_estimate(self, tokens: int, hidden: int, intermediate: int, width: int) -> tuple[float, str]:
        """train/memory.py's drafter row: its `num_layers` verifier layers, one step."""
        return layer_activations(self.hparams, tokens, hidden, intermediate, width)

    def __init__(
        self,
        verifier: Verifier,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        warmup_ratio: float = 0.05,
        num_layers: int = 4,
        loss: str = "kl",
        lk_eta: float = 3.0,
        val_steps: int = 5,
    ) -> None:
        super().__init__()
        check_loss(loss)
        check_eta(lk_eta)
        if isinstance(val_steps, bool) or not isinstance(val_steps, int) or val_steps < 1:
            raise UserError(f"model.val_steps={val_steps!r}: the chain depth validation counts must be a whole "
                            f"number >= 1 (default 5).")
        # Plain values only: checkpoints must load with torch.load(weights_only=True) when resuming.
        self.save_hyperparameters(ignore=["verifier", "optimizer", "scheduler"], logger=False)
        self.verifier = verifier
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        draft = truncate(verifier.model, num_layers, own=True, key="model.num_layers")
        # Only the draft's own parts are children (trained, checkpointed); the whole LM is held outside the module
        # tree so the verifier's embeddings and head never enter a checkpoint.
        self.layers: nn.ModuleList = draft.model.layers.train()
        self.norm: nn.Module = draft.model.norm.train()
        self._draft = (draft,)
        self._val: list[Tensor] | None = None
        self.val_metrics: dict[str, float] = {}

    @property
    def draft(self) -> nn.Module:
        """The whole draft causal LM (the verifier's embeddings and head, this module's layers and norm)."""
        return self._draft[0]

    # -- the shared step -------------------------------------------------------------------------------------------
    def draft_logits(self, batch: dict[str, Tensor], valid: Tensor) -> Tensor:
        """The draft's own forward over the input ids; its logits at the `valid` positions. (N, V)"""
        body = self.draft.model
        embeds = body.embed_tokens(batch["input_ids"]).to(self.norm.weight.dtype)  # (B, T, D)
        hidden = body(inputs_embeds=embeds, attention_mask=batch["attention_mask"], use_cache=False).last_hidden_state
        lm_head = self.draft.lm_head
        return lm_head(hidden[valid].to(lm_head.weight.dtype))

    def model_step(self, batch: dict[str, Tensor], train: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (mean loss, KL summed over positions, agreements summed), the sums for token-weighted validation."""
        return self.step_sums(batch, train)[:3]

    def step_sums(self, batch: dict[str, Tensor], train: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """model_step's, and the expected accepted length summed over positions (validation; 0 in training)."""
        if self.verifier.device != self.device:
            self.verifier.to(self.device)
        valid = next_token_positions(batch["loss_mask"])
        with torch.no_grad():
            hidden = gather_layers(batch, self.hidden_layers, self.verifier, [-1])[-1]  # (B, T, D)
            q_logits = self.verifier.lm_head(hidden[valid])  # (N, V)
        p_logits = self.draft_logits(batch, valid)  # (N, V)
        hp = self.hparams
        per_row, p_arg, alpha = chunked_loss(p_logits, q_logits.float().softmax(-1), loss=hp.get("loss", "kl"),
                                             eta=hp.get("lk_eta", 3.0), want_alpha=not train)
        loss = per_row.mean() if per_row.numel() else p_logits.sum() * 0.0
        kl, agree = per_row.detach(), q_logits.argmax(-1) == p_arg  # (validation recomputes the exact KL below)
        expected = per_row.new_zeros(())
        if not train:
            with torch.no_grad():
                kl, agree = kl_and_agreement(q_logits, p_logits.detach())
                grid = torch.zeros(valid.shape, device=alpha.device)
                grid[valid] = alpha.float()
                depth = int(hp.get("val_steps", 5))
                windows = F.pad(grid, (0, depth - 1)).unfold(1, depth, 1)  # (B, T, depth): alpha at t .. t+depth-1
                expected = (1 + chain_acceptance(windows))[valid].sum()
        return loss, kl.detach().sum(), agree.float().sum(), expected

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, _, agree = self.model_step(batch, train=True)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"training diverged at step {self.global_step}: the training loss is {loss.item()}. "
                f"{last_good_advice(self._trainer)}"
            )
        bsz = batch["input_ids"].shape[0]
        n = next_token_positions(batch["loss_mask"]).sum().clamp(min=1)
        self.log("train/loss", loss, prog_bar=True, batch_size=bsz)
        self.log("train/top1", agree / n, batch_size=bsz)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        _, kl_sum, agree, expected = self.step_sums(batch, train=False)
        n = next_token_positions(batch["loss_mask"]).sum().to(kl_sum)
        sums = torch.stack([kl_sum, agree, n, expected.to(kl_sum)])
        self._val = sums if self._val is None else self._val + sums

    def on_validation_epoch_end(self) -> None:
        if self._val is None:
            return
        kl_sum, agree, n, expected = self.trainer.strategy.reduce(self._val, reduce_op="sum").tolist()
        self._val = None
        metrics = {"val/kl": kl_sum / max(n, 1.0), "val/top1": agree / max(n, 1.0),
                   "val/expected_accepted_length": expected / max(n, 1.0)}
        for key, value in metrics.items():
            self.log(key, value, prog_bar=True)
        if not self.trainer.sanity_checking:
            self.val_metrics = metrics

    # -- export ----------------------------------------------------------------------------------------------------
    def export(self, path: str | Path) -> Path:
        """A plain HF checkpoint of the draft (k layers) with the verifier's tokenizer and fingerprint."""
        extra = {"trained_steps": self.trained_steps, **{k.replace("/", "_"): v for k, v in self.val_metrics.items()},
                 **data_record(self._trainer)}
        return save_draft_model(self.draft, self.verifier, path, extra)

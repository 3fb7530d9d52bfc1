"""What every drafter training module shares: AdamW-style optimizer over the trainable parameters with a warmup
schedule, the throughput logs (`train/tokens_per_s`, `train/assistant_tokens_per_s`,
`train/wall_assistant_tokens_per_s`), and the depth-1 training accuracy of the last epoch that exports record
(`train_depth1_top1`, beside the validation figures: the train/held-out gap says whether data or capacity limits).
The verifier is a plain object (never a submodule), so `parameters()` are the drafter's own."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import torch
from lightning.fabric.utilities.data import AttributeDict
from torch import Tensor

from models.exports.io import Export, frequent_ids
from models.families import a_title, title
from runtime.distributed import token_share, world
from runtime.errors import UserError

if TYPE_CHECKING:
    from models.verifiers.core import Verifier

TOPK = 10  # top-k accuracies exports record per head or depth, for tree construction: top-1 .. top-10


class DrafterModule(L.LightningModule, ABC):
    """Subclasses set `self.optimizer_factory` (a partial optimizer), `self.scheduler_factory` (a partial schedule
    taking (optimizer, num_warmup_steps, num_training_steps), or None) and save `warmup_ratio` in their hparams.

    What train.py, train/export.py and train/memory.py call on every training module is declared here: the abstract
    `hidden_layers`, `export` and `activation_estimate` each family's module implements, and `uses_verifier_argmax`,
    `warm_start`, `trained_steps` and `train_summary` with their defaults."""

    @property
    @abstractmethod
    def hidden_layers(self) -> list[int]:
        """The verifier hidden states training reads, as ids into HF's `output_hidden_states` (-1: the final-normed
        last layer, the lm_head input); train.py hands them to the data module, whose offline mode caches them."""

    @abstractmethod
    def export(self, path: str | Path) -> Path:
        """Write the trained drafter in its family's on-disk format at `path` (train/export.py calls it on fit end,
        train.py after validate_only); returns the export directory."""

    @abstractmethod
    def activation_estimate(self, tokens: int, hidden: int, intermediate: int, width: int) -> tuple[float, str]:
        """The drafter's activations kept for the backward of one step over `tokens` = B x T positions, for a
        verifier of `hidden` / `intermediate` sizes in `width`-byte values: (bytes, how they were counted, as
        train/memory.py prints it). An estimate, stated by its formula."""

    # Set by every subclass's __init__ (declared here so the shared code below is typed: nn.Module's attribute lookup
    # would otherwise type them as a Tensor or a Module).
    verifier: Verifier  # the frozen verifier, a plain attribute (never a submodule)
    optimizer_factory: Callable[..., torch.optim.Optimizer]  # params= -> the optimizer
    scheduler_factory: Callable[..., Any] | None  # (optimizer, num_warmup_steps=, num_training_steps=) -> a schedule

    # True: the module's targets read M_q's full-vocabulary argmax, which offline mode then caches beside the hidden
    # states (train.py sets the data module's `verifier_argmax` from it).
    uses_verifier_argmax: bool = False

    _tick = 0.0
    _epoch_start: float | None = None  # when this epoch's first training batch started
    _epoch_assistant: float = 0  # assistant tokens of this epoch's training batches so far
    _train_d1: Tensor | None = None  # (hits, positions) of depth-1 top-1 over this epoch's training batches
    train_summary: dict[str, float] = {}
    target_counts: Tensor | None = None  # (V,) how often each token is a training target, exported beside the weights
    data_target_counts: Tensor | None = None  # the same, counted on this run's training split (differs after init_from)

    def configure_optimizers(self) -> Any:
        # named: a factory that splits parameters by role reads the names (train/muon.py); torch's others take them
        opt = self.optimizer_factory(params=[(n, p) for n, p in self.named_parameters() if p.requires_grad])
        self._given_lrs = [float(g["lr"]) for g in opt.param_groups]  # before a schedule or a resume changes them
        if self.scheduler_factory is None:
            return opt
        total = int(self.trainer.estimated_stepping_batches)
        hparams = cast(AttributeDict, self.hparams)  # save_hyperparameters stores an AttributeDict
        sched = self.scheduler_factory(opt, num_warmup_steps=int(hparams.warmup_ratio * total),
                                       num_training_steps=max(total, 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    _given_lrs: list[float] = []  # each param group's learning rate as this run's settings give it

    def on_train_start(self) -> None:
        """A resume restores the checkpoint's optimizer and schedule, their learning rates included (Lightning loads
        them after configure_optimizers): put back the rates this run was given (model.optimizer.lr, and adamw_lr
        under Muon, may change on resume: train/resume.py), the schedule going on at its step."""
        for opt in self.trainer.optimizers:
            schedules = [c.scheduler for c in self.trainer.lr_scheduler_configs if c.scheduler.optimizer is opt]
            was = apply_lrs(opt, schedules, self._given_lrs)
            if was is not None and self.trainer.is_global_zero:
                print(f"[resume] learning rate {_rates(was)} -> {_rates(self._given_lrs)} "
                      f"(model.optimizer), the schedule going on from step {self.global_step}")

    def on_train_epoch_start(self) -> None:
        self._epoch_start, self._epoch_assistant = None, 0
        self._train_d1 = None

    def on_train_batch_start(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._tick = time.perf_counter()
        if self._epoch_start is None:
            self._epoch_start, self._epoch_assistant = self._tick, 0
        if "loss_mask" in batch:
            self._rank_weight = token_share(batch["loss_mask"].sum())

    # -- several processes (trainer=ddp): each rank's loss weighs by its share of the global batch's targets --------
    _rank_weight: Tensor | float = 1.0

    global_means = False  # True: the module's loss terms are global means already (global_mean), not rank means

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """DDP averages the ranks' gradients, and each rank's loss is a mean over its own assistant tokens, so a rank
        whose batch holds few targets would count as much as one whose batch holds many. Scaling rank r's loss by
        W * n_r / sum(n) makes the averaged gradient the gradient of the mean over the global batch's targets, as
        one process training on the whole global batch computes it. The logged loss stays the rank's own. Modules
        whose loss sums means over different position sets (EAGLE's unrolled steps) take each mean over the global
        batch instead (`global_mean`) and set `global_means`."""
        super().backward(loss if self.global_means else loss * self._rank_weight, *args, **kwargs)

    def global_mean(self, total: Tensor, count: Tensor | int) -> Tensor:
        """total / count in one process or outside training; under DDP, total * W / (count summed over the ranks):
        the term's mean over the global batch, scaled so that DDP's average of the ranks' gradients is its
        gradient. Every rank must call it as often, in the same order (it all-reduces the count)."""
        count = torch.as_tensor(count, dtype=torch.float32, device=total.device).reshape(1)
        rank_world = world()[1] if self.training else 1
        if rank_world > 1:
            count = count.clone()
            torch.distributed.all_reduce(count)
            return total * rank_world / count.clamp(min=1).squeeze(0)
        return total / count.clamp(min=1).squeeze(0)

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Throughput: `train/tokens_per_s` (every real token) and `train/assistant_tokens_per_s` (the tokens with
        targets) over this step's forward, backward and optimizer step; `train/wall_assistant_tokens_per_s` over the
        epoch so far, from its first batch's start, so data loading and everything between steps count too."""
        now = time.perf_counter()
        self.log("train/tokens_per_s", batch["attention_mask"].sum().item() / (now - self._tick), batch_size=1)
        if "loss_mask" not in batch:  # a batch without targets marked (not one of the data module's)
            return
        assistant = batch["loss_mask"].sum().item()
        self._epoch_assistant += assistant
        self.log("train/assistant_tokens_per_s", assistant / (now - self._tick), batch_size=1)
        assert self._epoch_start is not None  # on_train_batch_start set it for this epoch
        self.log("train/wall_assistant_tokens_per_s", self._epoch_assistant / (now - self._epoch_start), batch_size=1)

    def count_targets(self, vocab_size: int) -> Tensor | None:
        """Count how often each token is a training target (an assistant token of the training split), for the
        export's `target_counts.safetensors` (the decoder's `draft_vocab` keeps the most frequent). None
        without a data module's training split. After `warm_start` from an export trained with `model.train_vocab`,
        the export's counts are kept instead: they say which rows it trains over, and the new export must name the
        same rows."""
        counts = self.data_target_counts = self.data_counts(vocab_size)
        if counts is not None and self.warm is not None and self.warm.config.get("train_vocab"):
            counts = self.warm.target_counts
        self.target_counts = counts
        return counts

    def data_counts(self, vocab_size: int) -> Tensor | None:
        """How often each token is a target in this run's training split; None without a data module's."""
        train_set = getattr(getattr(self.trainer, "datamodule", None), "train_set", None)
        if train_set is None:
            return None
        counts = torch.zeros(vocab_size, dtype=torch.float64)
        for row in train_set.with_format("python"):
            ids = torch.tensor(row["input_ids"])
            counts += torch.bincount(ids[torch.tensor(row["loss_mask"]).bool()], minlength=vocab_size)
        return counts

    # -- warm start from an export (init_from=<export>) ------------------------------------------------------------
    warm: Export | None = None  # the export training started from, if any

    # `medusa`, `eagle` or `eagle3`: the export kind a module writes, if it can start from one
    drafter_kind: str | None = None
    drafter_net: torch.nn.Module  # the network an export holds (its state dict is the export's weights)

    def warm_start(self, export: Export, source: str) -> None:
        """Start from an export's weights (e.g. a drafter trained on a large general mix, fine-tuned on one domain's
        data). The export must be of this module's kind and shape; its vocabulary choices are kept: EAGLE-3's draft
        vocabulary (in its weights) and the rows `model.train_vocab` trained over (from its target counts), so the
        new export drafts over the same tokens. A checkpoint given with ckpt_path still wins (resuming)."""
        if self.drafter_kind is None:
            raise UserError(f"init_from={source!r}: only Medusa and EAGLE runs start from an export (model=medusa, "
                            f"eagle, eagle3). Drop init_from.")
        if export.kind != self.drafter_kind:
            raise UserError(f"init_from={source!r} is {a_title(export.kind)} export but this run trains "
                            f"{title(self.drafter_kind)} (model={self.drafter_kind}): pass model={export.kind}, "
                            f"or {a_title(self.drafter_kind)} export.")
        mine, theirs = self.drafter_net.state_dict(), export.net.state_dict()
        diff = sorted(set(mine) ^ set(theirs)) + sorted(k for k in set(mine) & set(theirs)
                                                        if mine[k].shape != theirs[k].shape)
        if diff:
            shapes = "; ".join(f"{k}: export {tuple(theirs[k].shape) if k in theirs else 'absent'}, model "
                               f"{tuple(mine[k].shape) if k in mine else 'absent'}" for k in diff[:4])
            raise UserError(f"init_from={source!r} does not match this model's shape ({shapes}). Set the model "
                            f"options to the export's (its config.json: e.g. model.num_heads, model.num_layers, "
                            f"model.draft_vocab_size, model.aux_layer_ids).")
        size = export.config.get("train_vocab")
        if self.hparams.get("train_vocab") not in (None, size):
            raise UserError(f"init_from={source!r} was trained over {size or 'all'} vocabulary rows "
                            f"(train_vocab={size}) and model.train_vocab={self.hparams.get('train_vocab')}: leave "
                            f"model.train_vocab unset, the export's rows are kept.")
        self.hparams["train_vocab"] = size
        if size and export.target_counts is None:
            _ = export.train_ids  # raises its error: the export does not record which rows
        with torch.no_grad():
            self.drafter_net.load_state_dict(theirs)
        self.warm = export
        print(f"[init_from] {title(export.kind)} weights from {source}"
              + (f", its {size} vocabulary rows" if size else ""))

    # -- training over the most frequent targets' rows of the verifier's lm_head (model.train_vocab) ---------------
    head_ids: Tensor | None = None  # the kept verifier ids, sorted; None: the full vocabulary
    _local: Tensor | None = None  # (V,) verifier id -> its row among head_ids, -1 outside
    _rows: Tensor | None = None  # the lm_head's head_ids rows, cut once per device and dtype

    def set_train_vocab(self, ids: Tensor) -> None:
        """Train and validate over the verifier ids `ids` (sorted) of the frozen lm_head only."""
        self.head_ids = ids.to(self.device)
        self._local = torch.full((self.verifier.vocab_size,), -1, dtype=torch.long, device=self.device)
        self._local[self.head_ids] = torch.arange(ids.numel(), device=self.device)
        self._rows = None

    def setup_train_vocab(self, counts: Tensor | None) -> None:
        """At setup: keep the `model.train_vocab` most frequent training targets, when it is set."""
        size = self.hparams.get("train_vocab")
        if size is None:
            return
        if counts is None:
            raise UserError("model.train_vocab needs the training split to count targets in; train through "
                            "train.py's data module, or leave model.train_vocab=null.")
        self.set_train_vocab(frequent_ids(counts, size, "model.train_vocab"))
        if self.warm is not None:  # the export's rows: say how much of this run's data they cover
            counts = self.data_target_counts
        assert counts is not None and self.head_ids is not None  # count_targets counted them; set_train_vocab set it
        covered = float(counts[self.head_ids.cpu()].sum() / counts.sum().clamp(min=1))
        print(f"[train_vocab] {size} tokens cover {100 * covered:.1f}% of the training targets")

    def head_rows(self, weight: Tensor) -> Tensor:
        """The kept rows of the frozen lm_head `weight` (V, D): (len(head_ids), D)."""
        if self._local is None or self.head_ids is None:
            raise RuntimeError("head_rows reads the kept rows: call set_train_vocab first (model.train_vocab set)")
        if self._local.device != weight.device:
            self.set_train_vocab(self.head_ids.to(weight.device))
        if self._rows is None or self._rows.device != weight.device or self._rows.dtype != weight.dtype:
            self._rows = weight.detach()[self.head_ids].contiguous()
        return self._rows

    def train_vocab_record(self) -> dict[str, int]:
        """What exports record, so the decoder drafts over the same rows (eval.drafters.build: draft_vocab)."""
        return {} if self.head_ids is None else {"train_vocab": int(self.head_ids.numel())}

    def count_depth1(self, hits: Tensor, positions: Tensor) -> None:
        """Add a training batch's depth-1 top-1 hits and scored positions to this epoch's tally."""
        step = torch.stack([hits.detach().float().sum(), positions.detach().float().sum()])
        self._train_d1 = step if self._train_d1 is None else self._train_d1 + step

    def on_train_epoch_end(self) -> None:
        if self._train_d1 is None:
            return
        hits, positions = self.trainer.strategy.reduce(self._train_d1, reduce_op="sum").tolist()
        if positions:
            # Measured on the batches as trained (EAGLE: noisy input features), while the weights moved over the epoch.
            self.train_summary = {"train_depth1_top1": hits / positions}
            self.log("train/epoch_depth1_top1", hits / positions)

    # The training record travels with checkpoints, so a resumed or re-validated run exports it too.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["train_summary"] = dict(self.train_summary)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.train_summary = dict(checkpoint.get("train_summary", {}))
        self._loaded_steps = int(checkpoint.get("global_step", 0))

    @property
    def trained_steps(self) -> int:
        """Optimizer steps behind these weights: the trainer's count, or the loaded checkpoint's when only validating
        (trainer.validate restores weights, not the loop's step count)."""
        return max(int(self.global_step), getattr(self, "_loaded_steps", 0))


def apply_lrs(opt: torch.optim.Optimizer, schedules: list[Any], given: list[float]) -> list[float] | None:
    """Set `opt`'s param groups to the base rates `given` (one per group) where a restored state holds others, and
    rescale `schedules` (theirs over `opt`) so each goes on at its step from the new base: a LambdaLR (transformers'
    warmup schedules) recomputed at its step, another scaled by new / old. Returns the rates the state held, or None
    when they were the given ones already."""
    groups = opt.param_groups
    if len(given) != len(groups):  # another optimizer than configure_optimizers built: not ours to set
        return None
    was = [float(g.get("initial_lr", g["lr"]) if schedules else g["lr"]) for g in groups]
    if was == given:
        return None
    now = [float(g["lr"]) for g in groups]
    for g, lr, old, cur in zip(groups, given, was, now):
        g["lr"] = lr * cur / old if schedules and old else lr
        if "initial_lr" in g:
            g["initial_lr"] = lr
    for schedule in schedules:
        schedule.base_lrs = list(given)
        lambdas = getattr(schedule, "lr_lambdas", None)
        if lambdas is not None and len(lambdas) == len(groups):  # closed form: exact even from a rate of 0
            for g, lr, factor in zip(groups, given, lambdas):
                g["lr"] = lr * factor(schedule.last_epoch)
        schedule._last_lr = [float(g["lr"]) for g in groups]
    return was


def _rates(lrs: list[float]) -> str:
    distinct = list(dict.fromkeys(lrs))
    return f"{distinct[0]:g}" if len(distinct) == 1 else "[" + ", ".join(f"{lr:g}" for lr in lrs) + "]"

"""VerifierFedModule: what every module that trains a drafter on the frozen verifier's features shares (EAGLE-1 and
EAGLE-3, train/eagle.py; P-EAGLE, train/peagle.py; DFlash and the block drafters built on it, train/dflash.py).

A training step reads M_q's hidden states (`prepare`: the drafter's features and the final-normed last layer, whose
lm_head gives q), runs the family's forward (`unrolled`: EAGLE's training-time test, P-EAGLE's parallel depths,
DFlash's blocks), each step's outputs against q at its targets (`model_step`: the token loss, through the verifier's
head or the drafter's own over a draft vocabulary, fused and chunked; `model.loss` picks it, train/losses.py), then
each step's loss weighted step_decay^j or per position by `slot_weights` (`finish`). Validation logs each step's
top-1, the estimated tau (the acceptance length a chain of the drafter's top-1 would get against M_q's argmax, plus
the bonus token) and `val/expected_accepted_length`, the same chain under rejection sampling: 1 + sum_k prod_{j<=k}
alpha_j, alpha_j = sum_v min(p_v, q_v) at depth j (q renormalised over the draft vocabulary where the drafter has
one, as its loss reads it). The best checkpoint is the one with the largest (conf/train.yaml). Exports record the
per-step top-k table tree planning reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from data.hidden_cache import gather_layers
from models.eagle import UnrolledStep, VerifierFedNet, target_rank
from models.exports.io import check_vocab_size, save_export
from models.families import title
from models.verifiers.core import Verifier
from runtime.errors import NonFiniteLossError, UserError
from train.base import TOPK, DrafterModule
from train.export import data_record
from train.losses import chain_acceptance, check_eta, check_loss, chunked_loss, frozen_head_loss
from train.memory import layer_activations
from train.safety import last_good_advice


def draft_vocab_from_counts(counts: Tensor, size: int) -> tuple[Tensor, float]:
    """The `size` most frequent target tokens and the share of training tokens they cover."""
    top = counts.topk(size).indices
    return top, float(counts[top].sum() / counts.sum().clamp(min=1))


def validation_tallies(correct: Tensor, valid: Tensor, rank: Tensor, topk: int = TOPK,
                       alpha: Tensor | None = None) -> dict[str, Tensor]:
    """One validation batch's sums, from the unrolled steps' top-1 hits `correct`, `valid` targets and target `rank`
    (S, B, n) each (rank 0 = the draft's top-1): per step, top-1 hits and valid targets; over positions whose first
    target is valid, the accepted chain lengths and their count; and, where the chain of top-1 drafts reaches step j
    (step 0: every valid position), how often M_q's token is within the draft's top-1..top-`topk` there. With the
    steps' acceptance probabilities `alpha` (S, B, n), also the expected accepted drafts of each chain under
    rejection sampling, sum_k prod_{j<=k} alpha_j (an invalid step ends the chain), summed over those positions."""
    lead = (correct & valid).long().cumprod(dim=0)  # (S, B, n): steps 0..j all right
    start = valid[0]
    reach = torch.cat([start[None], lead[:-1].bool() & valid[1:]])  # (S, B, n)
    within = rank[..., None] < torch.arange(1, topk + 1, device=rank.device)  # (S, B, n, topk)
    extra = {} if alpha is None else {
        "expected_accept": chain_acceptance((alpha * valid).permute(1, 2, 0))[start].sum().float()}
    return extra | {"hits": correct.flatten(1).sum(1).float(), "counts": valid.flatten(1).sum(1).float(),
            "accept": lead.sum(dim=0)[start].sum().float(), "starts": start.sum().float(),
            "topk_hits": (within & reach[..., None]).flatten(1, 2).sum(1).float(),  # (S, topk)
            "reached": reach.flatten(1).sum(1).float()}


def validation_summary(agg: dict[str, Tensor]) -> dict[str, Any]:
    """What exports record from the summed tallies: `val_step_top1` (each step's top-1 over its valid targets),
    `estimated_tau` (1 + the mean accepted chain) and `eagle_topk_accuracy` (S, topk), the cumulative top-k where
    the chain reaches each step: the per-depth table tree planning reads
    (models.exports.io.ExportInfo.acceptance)."""
    acc = agg["hits"] / agg["counts"].clamp(min=1)
    tau = 1 + agg["accept"] / agg["starts"].clamp(min=1)
    topk = agg["topk_hits"] / agg["reached"].clamp(min=1)[:, None]
    extra = {} if "expected_accept" not in agg else {
        "expected_accepted_length": float(1 + agg["expected_accept"] / agg["starts"].clamp(min=1))}
    return {"val_step_top1": acc.tolist(), "estimated_tau": float(tau), "eagle_topk_accuracy": topk.tolist()} | extra


def refuse_held_mask_token(counts: Tensor, mask: int, verifier: Verifier) -> None:
    """A parallel drafter's mask token must be one the training targets never hold (a mask slot would read as it)."""
    if bool(counts[mask] > 0):
        raise UserError(f"model.mask_token_id={mask} ({verifier.tokenizer.decode([mask])!r}) is a training target "
                        f"{int(counts[mask])} times: a mask slot would read as that token. Pick a token the data "
                        f"never holds.")


@dataclass
class StepTally:
    """One model_step's per-step tallies, (B, n) each per step: top-1 hits, valid targets, the detached acceptance
    probabilities alpha = sum_v min(p, q); validation: M_q's argmax's rank under the draft logits (`vocab_size`
    where invalid or outside the draft vocabulary) and the draft's confidence in its top-1."""

    vocab_size: int
    correct: list[Tensor] = field(default_factory=list)
    valid: list[Tensor] = field(default_factory=list)
    alpha: list[Tensor] = field(default_factory=list)
    rank: list[Tensor] = field(default_factory=list)
    confidence: list[Tensor] = field(default_factory=list)

    def add(self, step: UnrolledStep, hits: Tensor, alpha: Tensor, rank: Tensor | None = None,
            top1: Tensor | None = None) -> None:
        """A step's rows (N,) each at its targets (`step.batch`, `step.position`): hits, alpha (empty: none
        computed), and in validation the rank and the top-1 probability."""
        valid, bi, ti = step.valid, step.batch, step.position
        hit = torch.zeros_like(valid)
        hit[bi, ti] = hits
        at = torch.zeros(valid.shape, device=valid.device)
        if alpha.numel():
            at[bi, ti] = alpha.float()
        self.correct.append(hit)
        self.valid.append(valid)
        self.alpha.append(at)
        if rank is None or top1 is None:
            return
        ranks = torch.full(valid.shape, self.vocab_size, dtype=torch.long, device=valid.device)
        ranks[bi, ti] = rank
        self.rank.append(ranks)
        conf = torch.zeros(valid.shape, device=valid.device)
        conf[bi, ti] = top1
        self.confidence.append(conf)


def check_head_args(net_class: type[VerifierFedNet], train_vocab: int | None, loss: str, lk_eta: float) -> None:
    """The loss, its eta and `train_vocab` against the family's head, checked before its network is built (a module
    that builds its own, as EAGLE's does, calls this first: these refusals come before the network's own)."""
    check_loss(loss)
    check_eta(lk_eta)
    if train_vocab is not None and not net_class.shares_verifier_head:
        raise UserError(f"model.train_vocab={train_vocab} cuts the rows of the verifier's lm_head that a drafter "
                        f"drafts through; {title(net_class.kind)} drafts over its own head: use "
                        f"model.draft_vocab_size.")


class VerifierFedModule(DrafterModule):
    """Args (the families' modules pass them on; train/eagle.py, train/peagle.py, train/dflash.py say what each is):
        verifier: the frozen M_q, held by reference (never in checkpoints).
        net: the family's network (models.eagle.VerifierFedNet); its `shares_verifier_head` says whether the loss
            goes through the verifier's head or the drafter's own over a draft vocabulary.
        ttt_steps: the steps the training loss reads; val_steps: the steps validation reads.
        step_decay: step j's loss weight is step_decay^j (`step_weight`).
        train_vocab: train and validate a head shared with the verifier over the N most frequent training targets'
            rows of its lm_head (q renormalised over the same rows). null: all V.
        loss, lk_eta: what each step minimises between p and q (train/losses.py) and lk_hybrid's eta.

    A family's module supplies its forward (`unrolled`) and may override the hooks of a step: `prepare` (the
    features), `feature_loss` / `weigh_terms` (a loss beside the token loss), `slot_weights` / `step_weight`.
    """

    global_means = True  # each unrolled step's loss is a mean over the global batch (DrafterModule.global_mean)

    def __init__(self, verifier: Verifier, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None, net: VerifierFedNet, ttt_steps: int = 1, val_steps: int = 5,
                 step_decay: float = 0.8, warmup_ratio: float = 0.05, train_vocab: int | None = None,
                 loss: str = "kl", lk_eta: float = 3.0) -> None:
        super().__init__()
        check_head_args(type(net), train_vocab, loss, lk_eta)
        if train_vocab is not None:
            check_vocab_size(train_vocab, verifier.vocab_size, "model.train_vocab")
        if isinstance(step_decay, bool) or not isinstance(step_decay, (int, float)) or not step_decay > 0:
            raise UserError(f"model.step_decay={step_decay!r}: unrolled step j's loss weight is step_decay^j, so give "
                            f"a number above 0 (default 0.8).")
        self.save_hyperparameters(ignore=["verifier", "optimizer", "scheduler", "net"], logger=False)
        self.hparams["kind"] = net.kind  # the family trained
        self.verifier = verifier
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.net = net
        self.draft_vocab_coverage: float | None = None
        self._val: dict[str, Tensor] = {}
        self.val_summary: dict[str, Any] = {}

    @property
    def hidden_layers(self) -> list[int]:
        """Verifier hidden states training reads (ids into HF output_hidden_states): the drafter's features and the
        final-normed last layer (-1), whose lm_head gives q and, for EAGLE-1, the feature targets."""
        return list(dict.fromkeys([*self.net.feature_layers, -1]))

    def activation_estimate(self, tokens: int, hidden: int, intermediate: int, width: int) -> tuple[float, str]:
        """train/memory.py's drafter row: its layers once per unrolled training step (`ttt_steps`; P-EAGLE's
        parallel tokens; DFlash's `num_layers`)."""
        return layer_activations(self.hparams, tokens, hidden, intermediate, width)

    @property
    def uses_verifier_argmax(self) -> bool:
        """A draft vocabulary's targets need M_q's full-vocabulary argmax (is it in the draft vocabulary?): offline
        mode caches it once (batch["verifier_argmax"]) instead of projecting every target through the 49k-row head
        each epoch."""
        return not self.net.shares_verifier_head

    @property
    def drafter_kind(self) -> str:
        return self.net.kind

    @property
    def drafter_net(self) -> torch.nn.Module:
        return self.net

    # -- draft vocabulary (an own head: EAGLE-3, P-EAGLE) ---------------------------------------------------------
    def setup(self, stage: str) -> None:
        # The training-target counts: exported beside the weights, and the draft vocabulary when training starts.
        counts = self.count_targets(self.net.vocab_size) if stage in ("fit", "validate") else None
        if stage in ("fit", "validate"):
            self.setup_train_vocab(counts)
        if counts is not None and stage == "fit" and getattr(self.net, "mask_token_id", None) is not None:
            refuse_held_mask_token(counts, self.net.mask_token_id, self.verifier)  # P-EAGLE's and DFlash's mask slots
        if counts is None or self.net.shares_verifier_head or stage != "fit":  # a draft vocabulary: own head
            return
        if self.warm is not None:  # the export's draft vocabulary came with its weights
            self.draft_vocab_coverage = float(counts[self.net.t2d.cpu()].sum() / counts.sum().clamp(min=1))
            return
        top, self.draft_vocab_coverage = draft_vocab_from_counts(counts, self.net.draft_vocab_size)
        self.net.set_draft_vocab(top)
        print(f"[eagle3] draft vocabulary: {self.net.draft_vocab_size} tokens cover "
              f"{100 * self.draft_vocab_coverage:.1f}% of the training targets")

    # -- the shared step -------------------------------------------------------------------------------------------
    def unrolled(self, feats: Tensor, ids: Tensor, attn: Tensor, loss_mask: Tensor, embed: torch.nn.Module,
                 steps: int, train: bool) -> Iterator[UnrolledStep]:
        """The drafter's outputs per step over a batch: the family's forward (EAGLE's training-time test, P-EAGLE's
        parallel depths, DFlash's blocks)."""
        raise NotImplementedError

    def prepare(self, batch: dict[str, Tensor], train: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """A step's inputs: the tokens, attention mask and assistant-token mask (B, T), M_q's final-normed hidden
        states (B, T, D: its lm_head input) and the drafter's features F_t (B, n, D), n = T - 1."""
        if self.verifier.device != self.device:
            self.verifier.to(self.device)
        ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"].bool()
        n = ids.shape[1] - 1
        states = gather_layers(batch, self.hidden_layers, self.verifier, self.hidden_layers)
        return ids, attn, loss_mask, states[-1], self.net.features(states)[:, :n]

    def feature_loss(self, h: Tensor, target: Tensor) -> Tensor | None:
        """A loss of a step's outputs h (N, D) against M_q's next features `target` (N, D), beside the token loss of
        a drafter that drafts through the verifier's head (EAGLE-1's regression); None: the token loss alone."""
        return None

    def weigh_terms(self, token: Tensor, feature: Tensor | None, per_row: Tensor, size: int) -> Tensor:
        """A step's loss (a drafter that drafts through the verifier's head) from its token loss's global mean and
        `feature_loss`'s sum over `size` values (None where it gave none or the step had no targets)."""
        return token

    def finish(self, tally: StepTally, step_loss: Callable[[int, Tensor | None], Tensor], train: bool
               ) -> dict[str, Any]:
        """model_step's outputs from the steps' tallies: per-step losses (`step_loss(j, that step's slot_weights
        (B, n) or None)`), top-1 hits, valid targets and alpha (S, B, n) each; validation: ranks and the draft's
        top-1 probability."""
        valid_all, alpha_all = torch.stack(tally.valid), torch.stack(tally.alpha)
        weights = self.slot_weights(alpha_all, valid_all)  # (S, B, n) or None: step_decay^j per step (_loss)
        losses = [step_loss(j, None if weights is None else weights[j]) for j in range(len(tally.valid))]
        # rank (validation): 0 = M_q's argmax is the draft's top-1, vocab_size = invalid or outside the draft
        # vocabulary; alpha: each step's sum_v min(p_v, q_v) (zeros in training unless reads_alpha)
        out = {"losses": losses, "correct": torch.stack(tally.correct), "valid": valid_all, "alpha": alpha_all}
        if train:
            return out
        return out | {"rank": torch.stack(tally.rank), "confidence": torch.stack(tally.confidence)}

    def model_step(self, batch: dict[str, Tensor], steps: int, train: bool) -> dict[str, Any]:
        """Unroll `steps` drafter steps over a batch. Returns per-step losses, correct/valid masks, target ranks and
        (validation) the draft's confidence in its top-1."""
        ids, attn, loss_mask, final, feats = self.prepare(batch, train)
        embed, lm_head = self.verifier.token_embedding, self.verifier.lm_head
        targets = (self.draft_vocab_targets(final, loss_mask, batch.get("verifier_argmax"))
                   if not self.net.shares_verifier_head else None)  # an own head over a draft vocabulary
        rows = None if self.head_ids is None else self.head_rows(lm_head.weight)  # train_vocab's kept rows
        hp = self.hparams
        want_alpha = not train or self.reads_alpha  # validation's expected length; D-PACE's slot confidences
        tally = StepTally(self.net.vocab_size)
        terms = []
        for j, step in enumerate(self.unrolled(feats, ids, attn, loss_mask, embed, steps, train)):
            # Targets: q at position t+j+1 (predicting x_{t+j+2}), where x_{t+j+2} is an assistant token.
            bi, ti, h = step.batch, step.position, step.at_targets  # h: (N, D) outputs there
            reg = None
            if train and targets is None and bi.numel():
                # Through the verifier's head: the fused loss to q through the frozen lm_head (train/losses.py)
                # With train_vocab both p and q live on the kept rows; the logged top-1 compares rows (no full pass).
                per_row, p_arg, q_arg, a = frozen_head_loss(h, lm_head.weight if rows is None else rows,
                                                            teacher=final[bi, ti + j + 1], loss=hp.get("loss", "kl"),
                                                            eta=hp.get("lk_eta", 3.0), want_alpha=want_alpha)
                reg = self.feature_loss(h, final[bi, ti + j + 1])
                hits = p_arg == q_arg
                keep, zero = None, None
            else:
                with torch.no_grad():
                    if targets is None:  # the verifier's head: q over the full vocabulary, at this step's positions
                        q_logits = lm_head(final[bi, ti + j + 1]).float()  # (N, V)
                        q_arg = q_logits.argmax(-1)  # (N,) M_q's greedy token
                        q = (q_logits if rows is None else q_logits[:, self.head_ids]).softmax(-1)  # (N, V or kept)
                        at = None
                    else:  # a draft vocabulary: q computed once per batch; this step's rows of it, read by chunks
                        at = targets["row"][bi, ti + j + 1]
                        q_arg, q = targets["arg"][at], targets["q"]  # (N,), (M, V_draft)
                if rows is None:
                    p_logits = self.net.logits(h, lm_head)  # (N, V or V_draft)
                else:
                    p_logits = F.linear(h.to(rows.dtype), rows)  # (N, kept)
                # A draft vocabulary skips targets it cannot express; train_vocab's kept rows span all of q.
                keep = self.net.t2d[q_arg] if targets is not None else None
                # (N,) each: the loss in fp32 (kl: -sum q log p), p's argmax, alpha = sum min(p, q)
                per_row, draft, a = chunked_loss(p_logits, q, at, loss=hp.get("loss", "kl"),
                                                 eta=hp.get("lk_eta", 3.0), want_alpha=want_alpha)
                if targets is None:
                    reg = self.feature_loss(h, final[bi, ti + j + 1])
                zero = p_logits.sum() * 0.0
                hits = (self.net.draft_to_target(draft) if rows is None else self.head_ids[draft]) == q_arg
            terms.append((per_row, keep, reg, h.numel(), bi, ti, zero))
            if train:  # ranks and confidences are validation's (a full-vocabulary pass each)
                tally.add(step, hits, a)
                continue
            p32 = p_logits.detach().float()
            if rows is None:
                rank = self.net.target_rank(p32, q_arg)
            else:  # rows are in verifier-id order: target_rank's mask form; an argmax outside them ranks V
                rank = target_rank(p32, q_arg, self._local >= 0)
            # the draft's confidence in its top-1, to compare with how often it is right
            tally.add(step, hits, a, rank, p32.softmax(-1).amax(-1))

        def step_loss(j: int, weights: Tensor | None) -> Tensor:
            per_row, keep, reg, size, bi, ti, zero = terms[j]
            w = per_row if weights is None else per_row * weights[bi, ti]
            if keep is not None:
                w = w * keep
            # the same means, in the same order, on every rank (DDP), targets at this step or none
            token = self.global_mean(w.sum(), per_row.numel() if keep is None else keep.sum())
            loss = token if targets is not None else self.weigh_terms(token, reg, per_row, size)
            return loss if bi.numel() or zero is None else zero

        return self.finish(tally, step_loss, train)

    # -- per-slot loss weights (block drafters: train/dflash.py) -----------------------------------------------------
    reads_alpha = False  # True: training needs each step's alpha (slot_weights reads it)

    def slot_weights(self, alpha: Tensor, valid: Tensor) -> Tensor | None:
        """Per-step, per-position loss weights (S, B, n) from the steps' detached acceptance probabilities `alpha` and
        `valid` targets (S, B, n); None: each step's mean weighs step_weight(j) (step_decay^j)."""
        return None

    def step_weight(self, j: int) -> float:
        """Unrolled step j's weight in the training loss."""
        return self.hparams.step_decay**j

    @torch.no_grad()
    def draft_vocab_targets(self, final: Tensor, loss_mask: Tensor, argmax: Tensor | None = None) -> dict[str, Tensor]:
        """EAGLE-3's targets, once per batch (every unrolled step reads the same positions, shifted): at each position
        s whose next token is an assistant token, M_q's argmax (a verifier id) and q restricted to the draft
        vocabulary. Returns row (B, T) -> index into arg (M,) and q (M, V_draft); -1 where there is no target.

        `argmax` (B, T): M_q's greedy tokens from the offline cache; then q needs only the draft vocabulary's rows
        of the head (2,048 of 49,152 in the large recipe) instead of a full-vocabulary projection per target."""
        sel = F.pad(loss_mask[:, 1:], (0, 1), value=False)  # (B, T): x_{s+1} is an assistant token
        qb, qs = sel.nonzero(as_tuple=True)
        row = torch.full(sel.shape, -1, dtype=torch.long, device=sel.device)
        row[qb, qs] = torch.arange(qb.numel(), device=sel.device)
        head = self.verifier.lm_head
        if argmax is None:
            q_logits = head(final[qb, qs]).float()  # (M, V)
            return {"row": row, "arg": q_logits.argmax(-1), "q": q_logits[:, self.net.t2d].softmax(-1)}
        arg = argmax.to(sel.device)[qb, qs]
        if bool((arg < 0).any()):
            raise UserError("batch['verifier_argmax'] has no greedy token (-1) at a target position: the argmax "
                            "cache does not match this batch. Delete <cache_dir>/hidden/<key>/argmax and rerun.")
        bias = None if getattr(head, "bias", None) is None else head.bias[self.net.t2d]
        q_logits = F.linear(final[qb, qs], head.weight[self.net.t2d], bias).float()  # (M, V_draft), verifier-id order
        return {"row": row, "arg": arg, "q": q_logits.softmax(-1)}

    def _loss(self, losses: list[Tensor]) -> Tensor:
        steps = self.hparams.ttt_steps
        return sum(self.step_weight(j) * loss for j, loss in enumerate(losses[:steps]))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        res = self.model_step(batch, self.hparams.ttt_steps, train=True)
        loss = self._loss(res["losses"])
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"training diverged at step {self.global_step}: the training loss is {loss.item()}. "
                f"{last_good_advice(self._trainer)}")
        bsz = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bsz)
        for j, step_loss in enumerate(res["losses"]):
            self.log(f"train/step{j}_loss", step_loss, batch_size=bsz)
        c, v = res["correct"], res["valid"]
        self.log("train/step0_top1", c[0].sum() / v[0].sum().clamp(min=1), batch_size=bsz)
        self.count_depth1(c[0].sum(), v[0].sum())
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        steps = max(self.hparams.ttt_steps, self.hparams.val_steps)
        res = self.model_step(batch, steps, train=False)
        self.log("val/loss", self._loss(res["losses"]), prog_bar=True, batch_size=batch["input_ids"].shape[0])
        stats = validation_tallies(res["correct"], res["valid"], res["rank"], alpha=res.get("alpha"))
        for key, val in stats.items():
            self._val[key] = self._val.get(key, 0) + val

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        agg = {k: self.trainer.strategy.reduce(v, reduce_op="sum") for k, v in self._val.items()}
        self._val = {}
        summary = validation_summary(agg)
        for j, a in enumerate(summary["val_step_top1"]):
            self.log(f"val/step{j}_top1", a)
        self.log("val/estimated_tau", summary["estimated_tau"], prog_bar=True)
        if "expected_accepted_length" in summary:
            self.log("val/expected_accepted_length", summary["expected_accepted_length"], prog_bar=True)
        if not self.trainer.sanity_checking:
            self.val_summary = summary

    # -- export ----------------------------------------------------------------------------------------------------
    def export(self, path: str | Path) -> Path:
        extra = {**self.val_summary, **self.train_summary, "trained_steps": self.trained_steps,
                 "drafter": title(self.net.kind), "draft_vocab_coverage": self.draft_vocab_coverage,
                 **self.train_vocab_record(), **data_record(self._trainer)}
        return save_export(self.net, self.verifier, path, extra, target_counts=self.target_counts)

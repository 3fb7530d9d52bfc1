"""On-policy distillation (OPD): an EAGLE-1 / EAGLE-3 export learns on its own drafts.

    python -m eval.rollout pretrained/eagle3-smollm2 --out outputs/rollout-eagle3 --num-prompts 96
    python train.py experiment=opd data.rollout=outputs/rollout-eagle3

The rollout (eval/rollout.py, data/onpolicy.py) recorded, for every round the drafter ran in our exact decoder,
where the round started (the root x_s), the drafter's own chain d_1..d_K and M_q's top-k at the root and at each
draft: the verifier's distribution at the drafter's positions, accepted or rejected. Training replays each round
as the decoder ran it: the training-time unroll (models.eagle.unroll) over the committed sequence, its step 0 at
t = s - 1 reading (x_s, F_{s-1}) as the round's first draft did, and step j reading the drafter's own d_j (not the
committed token) with its own step j-1 output, at the rotary position t + j, seeing the step-0 keys at positions
<= t and its own earlier steps: what the EagleDrafter computed when it drafted. Step j's target is the recorded q
at node j (the top-k, renormalised over what the drafter can draft), under the run's `model.loss`, weighted
step_decay^j. After a rejection the replay goes on with the drafter's own wrong tokens and the verifier's
distributions there (Draft-OPD's rejected blocks); before one the drafts are the committed tokens, and the replay
is the teacher-forced unroll at the positions rounds start at.

Beside it, the ordinary teacher-forced loss on the committed sequence (EagleModule's, weight `tf_weight`): the
verifier's own answers to the pool. `opd_weight=0` leaves exactly that: the control with the same data and steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from data.onpolicy import read_manifest
from models.eagle import step_inputs, unroll
from models.exports.io import Export
from models.families import a_title, title
from runtime.errors import NonFiniteLossError, UserError
from train.eagle import EagleModule
from train.losses import chunked_loss
from train.safety import last_good_advice

ON_POLICY_KINDS = ("eagle", "eagle3")  # the nets models.eagle.unroll replays (eval.rollout.ON_POLICY_NETS)
BATCH_KEYS = ("opd_start", "opd_count", "opd_drafts", "opd_q_ids", "opd_q_probs")


def replay_inputs(batch: dict[str, Tensor], ids: Tensor, loss_mask: Tensor, depth: int
                  ) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Each unrolled step's (tokens, valid) (B, n) replaying the batch's recorded rounds, and the round each
    position starts (B, n), -1 where none: step 0 at t = s - 1 reads the root x_s (the committed token), step j
    the round's own draft d_j; a position is a target at step j when the round recorded a (j+1)-th draft."""
    start, count, drafts = batch["opd_start"], batch["opd_count"], batch["opd_drafts"]
    bsz, n = ids.shape[0], ids.shape[1] - 1
    bi, ri = (start > 0).nonzero(as_tuple=True)
    ti = start[bi, ri] - 1
    round_of = torch.full((bsz, n), -1, dtype=torch.long, device=ids.device)
    round_of[bi, ti] = ri
    inputs = []
    for j in range(depth):
        tokens = step_inputs(ids, loss_mask, j)[0].clone()
        if j:
            tokens[bi, ti] = drafts[bi, ri, j - 1]
        valid = torch.zeros((bsz, n), dtype=torch.bool, device=ids.device)
        valid[bi, ti] = count[bi, ri] > j
        inputs.append((tokens, valid))
    return inputs, round_of


class OnPolicyModule(EagleModule):
    """EagleModule's arguments (train/eagle.py), and:
        opd_weight: the on-policy loss's weight (0: the teacher-forced control, same data and steps).
        tf_weight: the teacher-forced loss's weight on the committed sequences (0: on-policy only).
    """

    def __init__(self, *args: Any, opd_weight: float = 1.0, tf_weight: float = 1.0, **kwargs: Any) -> None:
        kind = kwargs.get("kind", "eagle")
        if kind not in ON_POLICY_KINDS:
            raise UserError(f"experiment=opd replays a drafter's chain step by step on the verifier's features: "
                            f"{', '.join(title(k) for k in ON_POLICY_KINDS)} (model=eagle3, model=eagle); "
                            f"model.kind={kind!r} cannot. Use model=eagle3 with an EAGLE-3 export.")
        for name, value in (("opd_weight", opd_weight), ("tf_weight", tf_weight)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise UserError(f"model.{name}={value!r}: give a weight of at least 0.")
        if opd_weight == 0 and tf_weight == 0:
            raise UserError("model.opd_weight=0 and model.tf_weight=0: nothing to learn. Give either a weight above 0 "
                            "(opd_weight=0: the teacher-forced control).")
        super().__init__(*args, **kwargs)
        self.hparams["opd_weight"], self.hparams["tf_weight"] = float(opd_weight), float(tf_weight)
        self._prepared: tuple[dict[str, Tensor], Any] | None = None

    # -- what it starts from and learns from -------------------------------------------------------------------------
    def warm_start(self, export: Export, source: str) -> None:
        if export.kind not in ON_POLICY_KINDS:
            raise UserError(f"init_from={source!r} is {a_title(export.kind)} export: experiment=opd replays "
                            f"{', '.join(title(k) for k in ON_POLICY_KINDS)} exports only (their chains are unrolled "
                            f"step by step). Pass an export of those, e.g. pretrained/eagle3-smollm2.")
        super().warm_start(export, source)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        dm = getattr(self.trainer, "datamodule", None)
        rollout = getattr(dm, "rollout", None)
        if rollout is None:
            raise UserError("experiment=opd learns from a rollout: pass data=onpolicy data.rollout=<the directory "
                            "python -m eval.rollout wrote>.")
        kind = read_manifest(rollout).get("kind")
        if kind != self.net.kind:
            raise UserError(f"data.rollout={rollout!r} was drafted by {a_title(str(kind))} export and this run "
                            f"trains {title(self.net.kind)}: pass model={kind} and init_from=<the export that drafted "
                            f"it>.")

    def prepare(self, batch: dict[str, Tensor], train: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """EagleModule's inputs, once per batch: the teacher-forced and on-policy passes read one verifier forward."""
        if self._prepared is not None and self._prepared[0] is batch:
            return self._prepared[1]
        out = super().prepare(batch, train)
        self._prepared = (batch, out)
        return out

    # -- the on-policy pass ----------------------------------------------------------------------------------------
    def columns(self, device: torch.device) -> Tensor:
        """(V,) each verifier id's column in the draft logits, -1 where the drafter cannot draft it: EAGLE-3's
        draft vocabulary, `train_vocab`'s kept rows, or every id."""
        if not self.net.shares_verifier_head:
            t2d = self.net.t2d.to(device)
            return torch.where(t2d, t2d.long().cumsum(0) - 1, -1)
        if self._local is not None:
            return self._local.to(device)
        return torch.arange(self.verifier.vocab_size, device=device)

    def on_policy(self, batch: dict[str, Tensor], train: bool) -> dict[str, Any]:
        """The replayed rounds' loss (sum over steps of step_decay^j x the step's mean) and per step the top-1
        hits (the drafter's argmax is M_q's) and the replayed positions counted."""
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise UserError(f"experiment=opd: the batch has no recorded rounds ({', '.join(missing)}): train on "
                            f"data=onpolicy data.rollout=<dir>.")
        ids, attn, loss_mask, _, feats = self.prepare(batch, train)
        embed, lm_head = self.verifier.token_embedding, self.verifier.lm_head
        depth = batch["opd_drafts"].shape[-1]  # every recorded draft (training and validation alike)
        inputs, round_of = replay_inputs(batch, ids, loss_mask, depth)
        cols = self.columns(ids.device)
        rows = None if self.head_ids is None else self.head_rows(lm_head.weight)
        hp = self.hparams
        total, hits, counts, losses = feats.new_zeros((), dtype=torch.float32), [], [], []
        for j, step in enumerate(unroll(self.net, feats, ids, attn, loss_mask, embed, depth, inputs=inputs)):
            bi, ti = step.batch, step.position
            r = round_of[bi, ti]
            q_ids, q_p = batch["opd_q_ids"][bi, r, j], batch["opd_q_probs"][bi, r, j].float()  # (N, k)
            h = step.at_targets
            p_logits = self.net.logits(h, lm_head) if rows is None else F.linear(h.to(rows.dtype), rows)
            at = cols[q_ids]  # (N, k): each recorded token's column, -1 outside what the drafter drafts
            q = torch.zeros(p_logits.shape, dtype=torch.float32, device=h.device)
            q.scatter_add_(1, at.clamp(min=0), q_p * (at >= 0))
            keep = (at[:, 0] >= 0) & (q.sum(-1) > 0)  # as the teacher-forced loss: M_q's argmax must be draftable
            q = q / q.sum(-1, keepdim=True).clamp(min=1e-12)
            q[~keep] = 1.0 / q.shape[-1]  # rows left out below; a valid distribution for the kernel
            per_row, draft, _ = chunked_loss(p_logits, q, None, loss=hp.get("loss", "kl"), eta=hp.get("lk_eta", 3.0),
                                             want_alpha=False)
            step_loss = self.global_mean((per_row * keep).sum(), keep.sum())
            losses.append(step_loss.detach())
            total = total + self.step_weight(j) * step_loss
            # top-1 over every replayed position, as the teacher-forced tallies count: M_q's argmax outside what the
            # drafter drafts is a miss (the round's alpha at that step, when the replay follows the recorded chain)
            hits.append(((draft == at[:, 0]) & keep).sum().float())
            counts.append(torch.tensor(float(draft.numel()), device=draft.device))
        if train and not total.requires_grad:  # no round in the batch: a zero that still reaches every weight
            total = total + sum(p.sum() * 0.0 for p in self.net.parameters() if p.requires_grad)
        return {"loss": total, "losses": losses, "hits": hits, "counts": counts}

    # -- the steps -------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        hp, bsz = self.hparams, batch["input_ids"].shape[0]
        self._prepared = None
        loss = torch.zeros((), device=self.device)
        if hp.tf_weight > 0:
            res = self.model_step(batch, hp.ttt_steps, train=True)
            tf = self._loss(res["losses"])
            loss = loss + hp.tf_weight * tf
            self.log("train/tf_loss", tf, batch_size=bsz)
            c, v = res["correct"], res["valid"]
            self.log("train/step0_top1", c[0].sum() / v[0].sum().clamp(min=1), batch_size=bsz)
            self.count_depth1(c[0].sum(), v[0].sum())
        opd = self.on_policy(batch, train=True)
        self._prepared = None
        if hp.opd_weight > 0:
            loss = loss + hp.opd_weight * opd["loss"]
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"training diverged at step {self.global_step}: the training loss is "
                                     f"{loss.item()}. {last_good_advice(self._trainer)}")
        self.log("train/loss", loss, prog_bar=True, batch_size=bsz)
        self.log("train/opd_loss", opd["loss"].detach(), batch_size=bsz)
        if opd["hits"]:
            self.log("train/opd_step0_top1", opd["hits"][0] / opd["counts"][0].clamp(min=1), batch_size=bsz)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._prepared = None
        super().validation_step(batch, batch_idx)
        opd = self.on_policy(batch, train=False)
        self._prepared = None
        self.log("val/opd_loss", opd["loss"], batch_size=batch["input_ids"].shape[0])
        for j, (h, c) in enumerate(zip(opd["hits"], opd["counts"])):
            self.log(f"val/opd_step{j}_top1", h / c.clamp(min=1), batch_size=max(int(c), 1))

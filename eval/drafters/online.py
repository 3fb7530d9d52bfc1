"""Test-time updates (`drafter.adapt=online`): the drafter learns while it decodes, from what each verify already
computed.

Every round the decode loop hands the drafter M_q's features at the positions it just committed (`propose`'s
`hidden`) and the committed tokens (`input_ids`): exactly a training row of the hidden-state cache, with the
verifier's own tokens as targets. `OnlineLearner` keeps the last `window` committed positions of the sequence being
decoded and, once `every` new answer tokens have come in, takes one optimizer step on them: the training-time
unroll (models.eagle.unroll, `depth` steps deep) with cross-entropy to the committed tokens x_{t+j+2}, on an fp32
master copy of the network (bf16 autocast beside a bf16 verifier, as training's bf16-mixed runs), then copies the
weights into the network that drafts. Only answer positions are targets (a prompt's next token is the user's, not
M_q's). The weights carry over from prompt to prompt for the learner's life (a run, a server's), the sequence's
buffer does not.

The output stays M_q's: only which tokens are drafted changes (greedy_match 1.0, the sampled rule unchanged), and
what an update costs is spent inside `propose`, so the decode's draft time and tokens/s count it.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.eagle import unroll
from runtime.errors import UserError

ADAPT_MODES = (None, "online")


@dataclass(frozen=True)
class AdaptSettings:
    """`drafter.adapt*`: the learning rate of AdamW over the drafter's weights; an update every `every` new answer
    tokens over the last `window` committed positions, unrolled `depth` drafter steps (1: the first draft only)."""

    lr: float = 3e-5
    every: int = 32
    window: int = 64
    depth: int = 1

    def __post_init__(self) -> None:
        for name in ("every", "window", "depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"drafter.adapt_{name}={value!r}: give a whole number of at least 1.")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < 1:
            raise UserError(f"drafter.adapt_lr={self.lr!r}: give a learning rate between 0 and 1 (e.g. 3e-4).")
        if self.window <= self.depth + 1:
            raise UserError(f"drafter.adapt_window={self.window} holds no target {self.depth} steps ahead: give a "
                            f"window longer than adapt_depth + 1 (e.g. 128).")


_FROZEN = [False]


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """No learner records or learns inside: eval's uncounted warm-up decode teaches no drafter the prompt it then
    measures."""
    _FROZEN[0] = True
    try:
        yield
    finally:
        _FROZEN[0] = False


def adapt_settings(adapt: Any, **options: Any) -> AdaptSettings | None:
    """conf/drafter's `adapt` and `adapt_<option>` keys (null: AdaptSettings' default) as settings, None when off."""
    if adapt not in ADAPT_MODES:
        raise UserError(f"drafter.adapt={adapt!r}: choose null (the export's weights as they are) or online (the "
                        f"drafter learns from the verifier's tokens while it decodes: eval/drafters/online.py).")
    given = {k.removeprefix("adapt_"): v for k, v in options.items() if v is not None}
    if adapt is None:
        if given:
            raise UserError(f"{', '.join(f'drafter.adapt_{k}' for k in given)} set with drafter.adapt=null: add "
                            f"drafter.adapt=online, or drop them.")
        return None
    return AdaptSettings(**given)


@runtime_checkable
class Adaptable(Protocol):
    """A drafter that can learn while it decodes (EAGLE-1, EAGLE-3): `learn_online` gives it an OnlineLearner."""

    def learn_online(self, settings: AdaptSettings) -> None: ...


class OnlineLearner:
    """The test-time learner of one EAGLE-1 / EAGLE-3 network (`net`, the one drafting: updated in place)."""

    def __init__(self, net: nn.Module, embed: nn.Module, lm_head: nn.Module, settings: AdaptSettings,
                 autocast: bool) -> None:
        self.net, self.embed, self.lm_head, self.settings, self.autocast = net, embed, lm_head, settings, autocast
        self.master = copy.deepcopy(net).float().train().requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                           weight_decay=0.0)
        self.feature_layers = tuple(net.feature_layers)
        self._ids: Tensor | None = None  # (T,) the sequence's tokens so far (its last: the next round's root)
        self._hidden: list[Tensor] = []  # features of committed positions, (S_i, D_f) pieces, the last `window`
        self._first_answer = 0  # the first position whose next token is M_q's (the prompt's length - 1)
        self._pending = 0  # answer targets come in since the last update
        self.updates, self.ms, self.losses = 0, 0.0, []

    def committed(self, input_ids: Tensor, hidden: Tensor) -> bool:
        """Record the S positions this round committed (features `hidden` (1, S, D_f), tokens `input_ids` (1, T));
        update once `every` answer targets have come in. True when the network's weights changed."""
        if _FROZEN[0]:
            return False
        s, n = hidden.shape[1], input_ids.shape[1] - 1
        if n == s:  # a new sequence (its prefill, whose token x_n is M_q's first): the weights stay, the buffer not
            self._hidden, self._first_answer, self._pending = [], n, 0
        else:
            self._pending += s  # each committed position brought one of M_q's tokens
        self._ids = input_ids[0].detach()
        self._hidden.append(hidden[0].detach())
        held = sum(h.shape[0] for h in self._hidden)
        while held - self._hidden[0].shape[0] >= self.settings.window:
            held -= self._hidden.pop(0).shape[0]
        if self._pending < self.settings.every:
            return False
        self._pending = 0
        return self.update()

    def update(self) -> bool:
        """One optimizer step over the buffered window; False when it holds no target yet."""
        assert self._ids is not None
        feats = torch.cat(self._hidden)[-self.settings.window:]  # (W, D_f), positions n-W..n-1
        n = self._ids.shape[0] - 1
        w = feats.shape[0]
        ids = self._ids[n - w: n + 1][None]  # (1, W+1): x_{t} for the window's positions and the root
        mask = torch.zeros_like(ids)
        answer = torch.arange(n - w, n + 1, device=ids.device) >= self._first_answer  # x_t is one of M_q's
        mask[0, answer] = 1
        if int(mask[0, 2:].sum()) == 0:
            return False
        start = time.perf_counter()
        with torch.inference_mode(False):  # the decode loop runs under inference mode; its tensors are copied out
            loss = self._step(feats.clone(), ids.clone(), mask.clone())
        if loss is None:
            return False
        self.updates += 1
        self.losses.append(loss)
        self.ms += 1e3 * (time.perf_counter() - start)
        return True

    def _step(self, feats: Tensor, ids: Tensor, mask: Tensor) -> float | None:
        with torch.enable_grad(), torch.autocast(ids.device.type, torch.bfloat16, enabled=self.autocast):
            layers = dict(zip(self.feature_layers, feats[None].float().split(feats.shape[-1] //
                                                                            len(self.feature_layers), dim=-1)))
            inputs = self.master.features(layers)  # (1, W, D)
            total, count = inputs.new_zeros((), dtype=torch.float32), 0
            for j, step in enumerate(unroll(self.master, inputs, ids, torch.ones_like(ids), mask, self.embed,
                                            self.settings.depth)):
                if not step.batch.numel():
                    continue
                logits = self.master.logits(step.out[step.batch, step.column][None], self.lm_head)[0].float()
                target = ids[step.batch, step.position + j + 2]
                if not self.master.shares_verifier_head:  # EAGLE-3: targets inside its draft vocabulary only
                    inside = self.master.t2d[target]
                    logits, target = logits[inside], (self.master.t2d.cumsum(0) - 1)[target[inside]]
                if target.numel():
                    total = total + F.cross_entropy(logits, target, reduction="sum")
                    count += target.numel()
            if not count:
                return None
            loss = total / count
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.master.parameters(), 1.0)
        self.optimizer.step()
        with torch.no_grad():
            for mine, master in zip(self.net.parameters(), self.master.parameters()):
                mine.copy_(master)
        return float(loss.detach())

    def describe(self) -> dict[str, Any]:
        """What report.json records of the learning: settings, updates taken, their time, the last losses."""
        s = self.settings
        return {"adapt": "online", "lr": s.lr, "every": s.every, "window": s.window, "depth": s.depth,
                "updates": self.updates, "update_ms": round(self.ms, 1),
                "loss_first": round(self.losses[0], 4) if self.losses else None,
                "loss_last": round(self.losses[-1], 4) if self.losses else None}

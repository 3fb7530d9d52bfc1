"""Muon for a drafter's hidden matrices, AdamW for the rest, as one optimizer (`model/optim=muon`).

Muon (torch.optim.Muon: momentum, then the update orthogonalised by Newton-Schulz iterations) takes the 2-D weight
matrices of the drafter's layers; AdamW takes everything else: norms, biases, anything not 2-D, degenerate [1, N] /
[N, 1] matrices, and the vocabulary-sized ones (embeddings, a draft head `lm_head`, DSpark's Markov factors, DFlash2's
codebooks), as speculators 0.9 splits them (`speculators/train/optimizers.py`, `_ADAMW_NAME_HINTS`).

`MuonAdamW` holds both and is one `torch.optim.Optimizer` to Lightning: its `param_groups` are Muon's groups then
AdamW's (the same dicts, so one LR schedule scales both: the schedule multiplies each group's own initial lr), its
`state` is one table both write into (their parameters are disjoint), and its `state_dict` / `load_state_dict` are
torch's over those groups, so a checkpoint saves and a resume restores both optimizers' moments and step counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from runtime.errors import UserError

# Names of 2-D parameters that stay with AdamW (speculators' hints, plus `embed` for any embedding table).
ADAMW_NAME_HINTS = ("embed", "lm_head", "codebook", "markov_w1", "markov_w2")


def takes_muon(name: str, param: Tensor) -> bool:
    """Whether Muon updates `param`: a trainable 2-D matrix with both sides > 1 that is not a vocabulary table."""
    return (param.requires_grad and param.ndim == 2 and min(param.shape) > 1
            and not any(hint in name for hint in ADAMW_NAME_HINTS))


def split_for_muon(named: Iterable[tuple[str, Tensor]]) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """(Muon's, AdamW's) trainable named parameters (`takes_muon`)."""
    muon: list[tuple[str, Tensor]] = []
    adamw: list[tuple[str, Tensor]] = []
    for name, p in named:
        if p.requires_grad:
            (muon if takes_muon(name, p) else adamw).append((name, p))
    return muon, adamw


def check_momentum(momentum: Any) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise UserError(f"model.optimizer.momentum={momentum!r}: Muon's momentum is a share of the last update kept, "
                        f"in [0, 1) (1 or more never forgets a gradient and diverges); speculators and torch use "
                        f"0.95.")
    return float(momentum)


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the hidden matrices, torch.optim.AdamW over the rest (module docstring).

    Args:
        params: the trainable parameters, named ((name, tensor) pairs: the split reads the names).
        lr: Muon's learning rate (with adjust_lr_fn="match_rms_adamw", Muon's update has AdamW's RMS, so AdamW's
            learning rate is the starting point, as Moonshot's recipe and torch's docstring say).
        momentum, nesterov, ns_steps, weight_decay, adjust_lr_fn: Muon's (torch.optim.Muon).
        adamw_lr, betas, adamw_weight_decay: AdamW's, for the rest.
    """

    def __init__(self, params: Iterable[tuple[str, Tensor]], lr: float = 1e-3, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, weight_decay: float = 0.0,
                 adjust_lr_fn: str | None = "match_rms_adamw", adamw_lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), adamw_weight_decay: float = 0.0) -> None:
        named = list(params)
        if any(not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)) for x in named):
            raise TypeError("MuonAdamW takes named parameters ((name, tensor) pairs): its split reads the names")
        momentum = check_momentum(momentum)
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
            raise UserError(f"model.optimizer.ns_steps={ns_steps!r}: Newton-Schulz iterations per step, a whole "
                            f"number >= 1 (5 is torch's and speculators' default).")
        muon, adamw = split_for_muon(named)
        if not muon:
            seen = ", ".join(f"{n} {tuple(p.shape)}" for n, p in adamw[:6]) or "no trainable parameter"
            raise UserError(f"model/optim=muon: this drafter has no 2-D hidden matrix for Muon to update (it trains "
                            f"{seen}{', ...' if len(adamw) > 6 else ''}: vectors, embeddings and vocabulary heads, "
                            f"which stay with AdamW). Train it with model/optim=adamw_cosine.")
        self.muon = torch.optim.Muon(muon, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                     weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn)
        self.adamw = torch.optim.AdamW(adamw, lr=adamw_lr, betas=betas, weight_decay=adamw_weight_decay) \
            if adamw else None
        super().__init__([p for _, p in named], {})
        self._link()

    def _link(self) -> None:
        """One list of groups (Muon's first) and one state table, shared with the two optimizers."""
        inner = [self.muon] + ([self.adamw] if self.adamw is not None else [])
        if not getattr(self, "_linked", False):
            self.param_groups = [g for opt in inner for g in opt.param_groups]
            self._linked = True
        else:  # after load_state_dict: hand the restored groups back, in the same order
            count = len(self.muon.param_groups)
            self.muon.param_groups = self.param_groups[:count]
            if self.adamw is not None:
                self.adamw.param_groups = self.param_groups[count:]
        for opt in inner:
            opt.state = self.state

    @property
    def muon_params(self) -> list[Tensor]:
        return [p for g in self.muon.param_groups for p in g["params"]]

    @property
    def adamw_params(self) -> list[Tensor]:
        return [] if self.adamw is None else [p for g in self.adamw.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()


def optimizer_state(factory: Any, named: list[tuple[str, Tensor]]) -> tuple[str, float, str]:
    """The memory table's row for the optimizer `factory` builds over the trainable `named` parameters: Muon keeps
    one fp32 momentum buffer per matrix weight it takes, AdamW two fp32 moments per weight (train/memory.py)."""
    target = getattr(factory, "func", factory)
    total = sum(p.numel() for _, p in named)
    if isinstance(target, type) and issubclass(target, MuonAdamW):
        muon, adamw = split_for_muon(named)
        m, a = sum(p.numel() for _, p in muon), sum(p.numel() for _, p in adamw)
        return ("Muon + AdamW states", (m + 2.0 * a) * 4,
                f"one fp32 momentum per Muon weight ({m:,}) + two fp32 moments per AdamW weight ({a:,})")
    return "AdamW states", 2.0 * total * 4, "two fp32 moments per trainable weight"


def hidden_matrices(module: nn.Module) -> list[str]:
    """The names of `module`'s parameters Muon would update (tests, messages)."""
    return [n for n, p in module.named_parameters() if takes_muon(n, p)]

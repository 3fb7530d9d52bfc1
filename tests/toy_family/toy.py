"""A whole drafter family in one file, outside the package: one linear head that reads M_q's last hidden state at t
and predicts token t+2 (a one-head Medusa without residual blocks, with its own projection). It is what a family is:
a network with its export layout, a training module, a drafter, two YAMLs (tests/toy_family/conf) and one registry
entry (`ENTRY`, added by `models.families.register`). Nothing in the package names it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data.hidden_cache import gather_layers
from eval.engine.protocol import Draft
from eval.engine.tree import chain
from models.exports.io import save_export
from models.families import ExportFormat, Family
from models.verifiers.core import Verifier
from runtime.errors import UserError
from train.base import DrafterModule

NAME = "toy"


# -- the network and its export layout (what models/<name>.py holds for a built-in family) -----------------------------

class ToyHead(nn.Module):
    """logits of token t+2 from M_q's final-normed hidden state at t: (..., D) -> (..., V)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.proj(hidden.to(self.proj.weight.dtype))


def toy_layout(net: ToyHead, verifier: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    config = {"model_type": "toy_head", "hidden_size": net.proj.in_features, "vocab_size": net.proj.out_features}
    return config, {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}


def toy_from_layout(config: dict[str, Any], tensors: dict[str, Tensor], verifier: Any, file: Path,
                    reference: bool) -> tuple[ToyHead, None]:
    net = ToyHead(int(config["hidden_size"]), int(config["vocab_size"]))
    net.load_state_dict(tensors, strict=True)
    return net, None


# -- training (what train/<name>.py holds) ---------------------------------------------------------------------------

class ToyModule(DrafterModule):
    """Cross-entropy of the head's logits at t against token t+2, over assistant targets."""

    hidden_layers = [-1]

    def __init__(self, verifier: Verifier, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, warmup_ratio: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["verifier", "optimizer", "scheduler"], logger=False)
        self.verifier = verifier
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.head = ToyHead(verifier.hidden_size, verifier.vocab_size)

    def activation_estimate(self, tokens: int, hidden: int, intermediate: int, width: int) -> tuple[float, str]:
        return tokens * self.verifier.vocab_size * width, f"~ B x T x V x {width} B (the logits)"

    def step(self, batch: dict[str, Tensor]) -> Tensor:
        if self.verifier.device != self.device:
            self.verifier.to(self.device)
        hidden = gather_layers(batch, self.hidden_layers, self.verifier, [-1])[-1]  # (B, T, D), no grad
        valid = batch["loss_mask"][:, 2:].bool()  # (B, T-2): position t's target t+2 is an assistant token
        logits = self.head(hidden[:, :-2][valid]).float()  # (N, V)
        return F.cross_entropy(logits, batch["input_ids"][:, 2:][valid])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.step(batch)
        self.log("train/loss", loss, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.step(batch), batch_size=batch["input_ids"].shape[0])

    def export(self, path: str | Path) -> Path:
        return save_export(self.head, self.verifier, path, {"trained_steps": self.trained_steps})


# -- decoding (what eval/drafters/<name>.py holds) -------------------------------------------------------------------

class ToyDrafter:
    """One draft a round: the head's top-1 for the token after the root, from M_q's hidden state before it."""

    feature_layers = (-1,)
    max_nodes, max_depth = 2, 1

    def __init__(self, net: ToyHead) -> None:
        self.net, self.tree = net, chain(1)

    def describe(self) -> dict[str, Any]:
        return {"policy": "chain", "size": 1}

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        root = input_ids[:, -1:]  # (B, 1)
        with torch.no_grad():
            draft = self.net(hidden[:, -1]).argmax(-1, keepdim=True)  # (B, 1)
        return Draft(tree=self.tree, tokens=torch.cat([root, draft.to(root.dtype)], dim=1))

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        pass  # stateless

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> None:
        """Not timed: one small matmul a round, planned as free."""
        return None


def toy_drafter(net: ToyHead, config: dict[str, Any], verifier: Verifier, tree: Any, sampling: Any = None,
                generator: Any = None, head_ids: Tensor | None = None) -> ToyDrafter:
    if sampling is not None:
        raise UserError("the toy family drafts top-1 only; drop sampled_drafts.")
    return ToyDrafter(net.to(verifier.device))


# -- the one registry entry ------------------------------------------------------------------------------------------

ENTRY = Family(NAME, "toy head", drafter="eval.drafters.build.export", decoder="toy_family.toy.toy_drafter",
               training="toy_family.toy.ToyModule", network=ToyHead, needs_export=True, tree="own",
               export=ExportFormat(("ToyHeadModel",), toy_layout, toy_from_layout, model_type="toy_head"))

"""Drafters: one protocol (eval.protocol), one factory. The decode loop never asks which drafter it holds.

`make_drafter` builds the drafter of any family with an export, from the export or from a network, through the
family's decoder in the registry (models/families.py). The drafters that need no export (a draft model, prompt
lookup, lookahead, the hybrid) are built by their factories in eval.families.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from eval.protocol import Draft, Drafter  # noqa: F401  (the protocol, importable from here as before)
from eval.sampling import SamplingConfig
from eval.tree import TreePolicy
from models.errors import UserError
from models.export import Export, frequent_ids, load_export
from models.families import EXPORT_FAMILIES, FAMILIES, family_of_net, resolve, title
from models.verifier import Verifier


def make_drafter(kind: str | None, verifier: Verifier, tree: TreePolicy,
                 checkpoint: str | Path | Export | None = None,
                 net: nn.Module | None = None, sampling: SamplingConfig | None = None,
                 generator: torch.Generator | None = None, draft_vocab: int | None = None) -> Drafter:
    """A drafter for `verifier` proposing trees under the policy `tree`, from an export (checkpoint=<dir>; `kind`
    None takes the export's own) or a network (net=<MedusaHeads or EAGLE net>, `kind` naming it). With `sampling`
    (temperature > 0) it samples its proposals from its warped distribution instead of taking the top-k.
    `draft_vocab` (EAGLE-1, shared-head Medusa): draft over the export's `draft_vocab` most frequent training targets
    only, through those rows of the verifier's lm_head. None: the export's `train_vocab` (a drafter trained over that
    many rows: train/base.py), else the full vocabulary."""
    if (checkpoint is None) == (net is None):
        raise UserError(f"make_drafter({kind!r}, ...) needs exactly one of checkpoint=<export dir> or net=<network>.")
    if kind is not None and kind not in EXPORT_FAMILIES:
        raise UserError(f"drafter={kind!r} is no family with an export; choose one of {sorted(EXPORT_FAMILIES)}.")
    config: dict[str, Any] = {}
    counts, export = None, None
    if checkpoint is not None:
        export = checkpoint if isinstance(checkpoint, Export) else load_export(checkpoint, verifier, kind)
        if kind is not None and export.kind != kind:
            raise UserError(f"the export is {title(export.kind)} but was given as {title(kind)}; use "
                            f"drafter={export.kind}.")
        kind, net, config, counts = export.kind, export.net, export.config, export.target_counts
    elif kind is None or family_of_net(net) != kind:
        found = family_of_net(net)
        raise UserError(f"net is a {title(found)} drafter but was given as {title(kind)}; use "
                        f"make_drafter({found!r}, ...).")
    net = net.to(verifier.device)
    if draft_vocab is None and config.get("train_vocab"):
        draft_vocab = config["train_vocab"]  # trained over those rows: draft over them
    head_ids = None
    if draft_vocab is not None:
        if not net.shares_verifier_head:
            raise UserError(f"drafter.draft_vocab={draft_vocab} cuts the verifier's lm_head that EAGLE-1 and "
                            f"shared-head Medusa draft through; this {title(kind)} drafter has its own head. "
                            f"Leave drafter.draft_vocab=null.")
        if counts is None:
            raise UserError(f"drafter.draft_vocab={draft_vocab} needs the export's training-target counts "
                            f"(target_counts.safetensors), and {export.path if export else 'the network given'} has none. Re-export it with a current "
                            f"train.py (python train.py <the run's overrides> ckpt_path=last validate_only=true), or "
                            f"leave drafter.draft_vocab=null.")
        head_ids = frequent_ids(counts, int(draft_vocab)).to(verifier.device)
    build = resolve(FAMILIES[kind].decoder)  # e.g. eval.medusa.medusa_drafter, eval.eagle.eagle_drafter
    return build(net, config, verifier, tree, sampling=sampling, generator=generator, head_ids=head_ids)

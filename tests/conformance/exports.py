"""The one place the conformance tests produce exports (models.exports.io.save_export).

Every export the conformance tests read is written by `write_export` below with the project's current exporters, so
the tests judge exactly what `train.py` writes on fit end. What the drafter was trained on (the ground truth the
engines' readings are compared with) is taken from the drafter object, never read back from the file under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from models.eagle import build_eagle
from models.exports.io import save_export
from models.medusa import MedusaHeads


@dataclass(frozen=True)
class Written:
    path: Path
    kind: str  # "medusa", "eagle", "eagle3"
    verifier_layers: int  # L
    vocab_size: int  # the verifier's (target) vocabulary
    hidden_size: int
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3: the HF hidden_states indices the drafter was trained on, in order


def write_export(kind: str, verifier, path: Path, *, draft_vocab_size: int | None = None,
                 aux_layer_ids: list[int] | None = None, num_heads: int = 3, num_layers: int = 1,
                 share_lm_head: bool = True) -> Written:
    """Write a `kind` export ("medusa", "eagle", "eagle3") for `verifier` into `path`.

    Weights are random (the checks read names, shapes and config only). An EAGLE-3 draft vocabulary smaller than the
    verifier's gets a real d2t/t2d (every other token id), as training would set from token counts.
    """
    gen = torch.Generator().manual_seed(0)
    info = dict(kind=kind, verifier_layers=int(verifier.config.num_hidden_layers), vocab_size=int(verifier.vocab_size),
                hidden_size=int(verifier.config.hidden_size))
    if kind == "medusa":
        heads = MedusaHeads(verifier.config.hidden_size, verifier.vocab_size, num_heads=num_heads,
                            num_layers=num_layers, share_lm_head=share_lm_head,
                            lm_head_init=verifier.lm_head.weight.detach())
        _randomise(heads, gen)
        return Written(save_export(heads, verifier, path, {"trained_steps": 1}), **info)
    net = build_eagle(kind, verifier, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids)
    _randomise(net, gen)
    if kind == "eagle3" and net.draft_vocab_size < verifier.vocab_size:
        net.set_draft_vocab(torch.arange(net.draft_vocab_size) * 2)
    out = save_export(net, verifier, path, {"trained_steps": 1})
    return Written(out, aux_layer_ids=tuple(net.aux_layer_ids) if kind == "eagle3" else (), **info)


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

"""The drafter protocol: what every drafter implements, and the Draft it returns. The decode loop never asks which
drafter it holds (eval.drafters builds one from an export, eval.families from a config).

Each round the loop hands a drafter M_p what the verifier M_q just produced: all tokens so far, whose last one is
the root of the next tree (chosen by the acceptance rule, not yet in M_q's cache), and M_q's hidden states at the
positions it just committed (the prompt after prefill, the accepted path after a round), of the layers the drafter
declared in `feature_layers`. The drafter owns the shape of what it proposes (its tree policy, eval.tree) and fills
that tree with tokens. After verification it is told how many drafts were accepted, and on which nodes, so that a
drafter with its own KV cache (EAGLE, a draft model) can roll it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from eval.tree import Tree


@dataclass
class Draft:
    """One round's proposal: the tree it fills (fixed, or grown this round) and a token per node, (B, N);
    node 0 is the root. p: (B, N, V) the warped distribution each node's token was drawn from (row 0 unused), when
    the drafter sampled its proposals; None for deterministic (top-k) drafts, which the sampling rule treats as
    one-hot p (eval.sampling)."""

    tree: Tree
    tokens: Tensor
    p: Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """What every drafter implements (Medusa, EAGLE, a draft model, prompt lookup, ...).

    feature_layers: the M_q hidden states it reads, as indices into HF's `hidden_states` (-1: the final-normed last
        layer, the lm_head input); the loop hands them concatenated on the last dimension, from the same forward.
    max_nodes / max_depth: the most nodes (root included) and levels a round's tree can have; the loop sizes the
        verifier's cache and the acceptance statistics on them.
    """

    feature_layers: tuple[int, ...]
    max_nodes: int
    max_depth: int

    def describe(self) -> dict[str, Any]:
        """The tree policy as report.json records it (what was really drafted)."""
        ...

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        """Fill this round's tree.

        input_ids: (B, T) every token so far; input_ids[:, -1] is the root.
        hidden: (B, S, len(feature_layers) * D) M_q's hidden states at the S positions it just committed;
            hidden[:, -1] is at the token before the root.
        """
        ...

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Told after verification: `num_accepted` (B,) drafts were accepted, on tree nodes `nodes` (B, 1+A)
        counted from the root, in the draft just verified."""
        ...

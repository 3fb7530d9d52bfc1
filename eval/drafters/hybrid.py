"""A hybrid drafter: a second drafter's tree (prompt-lookup continuations) grafted into the first one's (a Medusa or
EAGLE tree) under the first one's node budget, so both are verified in the same verifier forward.

Grafting merges the two as tries of tokens: a grafted node whose token already sits under the same parent reuses
that node, any other becomes a new child. The grafted nodes are kept first (a prompt-lookup match is rare and long
when it comes); to stay within `budget` nodes the primary's last nodes are dropped. Every tree here lists parents
before children, so the last node is always a leaf and dropping from the end keeps a tree; Medusa and EAGLE order
their nodes best-first, so what goes is their least likely nodes. A round without a match is the primary's own tree.

Greedy acceptance picks the longest matching path over all nodes, so on any round the hybrid accepts at least as
many tokens as the grafted tree alone, and as the primary tree alone whenever nothing of it had to be dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from eval.engine.protocol import Draft, Drafter
from eval.engine.tree import Tree
from runtime.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from models.verifier import Verifier


def graft(primary: Draft, extra: Draft, budget: int) -> tuple[Draft, list[int]]:
    """`extra`'s tree merged into `primary`'s (same root), at most `budget` nodes, primary nodes dropped from the
    end to make room. Returns the merged draft and, per merged node, its index in `primary` (-1: grafted)."""
    if extra.tree.num_drafts == 0 and primary.tree.num_nodes <= budget:  # nothing to graft: the primary's own tree
        return primary, list(range(primary.tree.num_nodes))
    p_tokens, e_tokens = primary.tokens[0].tolist(), extra.tokens[0].tolist()
    parents, tokens, origin = list(primary.tree.parents), list(p_tokens), list(range(len(p_tokens)))
    children: dict[tuple[int, int], int] = {(parents[i], tokens[i]): i for i in range(1, len(parents))}
    where = {0: 0}  # extra node -> merged node
    new_nodes: list[int] = []
    for j in range(1, extra.tree.num_nodes):
        key = (where[extra.tree.parents[j]], e_tokens[j])
        if key not in children:
            children[key] = len(parents)
            parents.append(key[0])
            tokens.append(e_tokens[j])
            origin.append(-1)
            new_nodes.append(children[key])
        where[j] = children[key]
    # Drop primary nodes from the end (leaves of the primary part) until the grafted ones fit in the budget.
    needed = set(where.values())
    for i in new_nodes:  # a grafted node's ancestors must stay too
        while i > 0:
            needed.add(i)
            i = parents[i]
    kept = list(range(len(parents)))
    drop = len(parents) - budget
    for i in range(len(p_tokens) - 1, 0, -1):
        if drop <= 0:
            break
        if i not in needed and not any(parents[c] == i for c in kept if c != i):
            kept.remove(i)
            drop -= 1
    if drop > 0:
        raise UserError(f"The grafted tree needs {len(needed)} nodes but the budget is {budget}; raise the budget "
                        f"or lower the grafted drafter's depth.")
    index = {old: new for new, old in enumerate(kept)}
    new_parents, ranks, seen = [-1], [-1], {}
    for old in kept[1:]:
        parent = index[parents[old]]
        seen[parent] = seen.get(parent, -1) + 1  # ranks only need to be distinct among siblings
        new_parents.append(parent)
        ranks.append(seen[parent])
    merged = torch.tensor([[tokens[i] for i in kept]], dtype=primary.tokens.dtype, device=primary.tokens.device)
    return Draft(tree=Tree(parents=tuple(new_parents), ranks=tuple(ranks)), tokens=merged), [origin[i] for i in kept]


class HybridDrafter:
    """`drafter=hybrid`: `primary` (Medusa, EAGLE, a draft model) with `extra`'s tree (prompt lookup) grafted in,
    within `budget` nodes (root included; default the primary's own max_nodes, i.e. the same verifier cost)."""

    def __init__(self, primary: Drafter, extra: Drafter, budget: int | None = None) -> None:
        if getattr(extra, "reads_hidden", True) and tuple(extra.feature_layers) != tuple(primary.feature_layers):
            raise UserError(f"A hybrid hands both drafters the same verifier features; {type(extra).__name__} reads "
                            f"layers {extra.feature_layers} and {type(primary).__name__} {primary.feature_layers}.")
        if hasattr(extra, "observe") or hasattr(primary, "observe"):
            raise UserError("Lookahead learns from the verifier's outputs on its own nodes and cannot be a hybrid "
                            "part; use prompt_lookup as the grafted drafter.")
        self.primary, self.extra = primary, extra
        self.max_nodes = primary.max_nodes if budget is None else budget
        if self.max_nodes < extra.max_nodes:
            raise UserError(f"hybrid budget={self.max_nodes} nodes cannot hold the grafted drafter's "
                            f"{extra.max_nodes}; raise drafter.budget or lower its depth.")
        self.feature_layers = primary.feature_layers
        self.max_depth = max(primary.max_depth, extra.max_depth)
        self._origin: list[int] = []

    def describe(self) -> dict[str, Any]:
        return {"policy": "hybrid", "max_nodes": self.max_nodes, "max_depth": self.max_depth,
                "primary": self.primary.describe(), "grafted": self.extra.describe()}

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        base = self.primary.propose(input_ids, hidden)
        extra = self.extra.propose(input_ids, hidden)
        draft, self._origin = graft(base, extra, self.max_nodes)
        return draft

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Each part is told the count; the nodes in the primary's tree (-1 where a node was grafted). The grafted
        drafter (prompt lookup) is stateless and is told the count alone."""
        origin = torch.tensor(self._origin, device=nodes.device)
        self.primary.accepted(num_accepted, origin[nodes])
        self.extra.accepted(num_accepted, torch.full_like(nodes, -1))

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> list[float] | None:
        """eval.engine.protocol.CostProbe: the primary's (tree.size=auto plans the primary's budget); the grafted prompt
        lookup's string search is left out."""
        return self.primary.draft_cost(verifier, prefix_ids, sizes, engine, reps)

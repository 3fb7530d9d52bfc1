"""A hybrid drafter: a second drafter's tree (prompt-lookup continuations) grafted into the first one's (a Medusa or
EAGLE tree) under the first one's node budget, so both are verified in the same verifier forward.

Grafting merges the two as tries of tokens: a grafted node whose token already sits under the same parent reuses
that node, any other becomes a new child. The grafted nodes are kept first (a prompt-lookup match is rare and long
when it comes); to stay within `budget` nodes the primary's last nodes are dropped. Every tree here lists parents
before children, so the last node is always a leaf and dropping from the end keeps a tree; Medusa and EAGLE order
their nodes best-first, so what goes is their least likely nodes. A round without a match is the primary's own tree.

Greedy acceptance picks the longest matching path over all nodes, so on any round the hybrid accepts at least as
many tokens as the grafted tree alone, and as the primary tree alone whenever nothing of it had to be dropped.

Under the planner (a primary that keeps eval.engine.protocol.Planned: tree.size=auto) the split is chosen each round
from what each source has been accepting on this prompt. Lookup's chain node i is worth a^i, a its continuation rate
(the fraction of its nodes offered on the accepted path that were accepted: a Beta mean, the run's rate as the
prompt's prior, LOOKUP_PRIOR the run's); the primary's nodes are worth what its planner predicts for them (measured
acceptance too). The round verifies the n best of both lists, n maximising (1 + their values) / (the round's ms at
n + 1 nodes): a prompt that copies its input gets long lookup chains beside a few drafter nodes, or on top of them,
a prompt that does not gets the drafter's tree alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from eval.engine.protocol import Draft, Drafter, Planned, Prediction
from eval.engine.tree import Tree, chain
from runtime.errors import UserError

if TYPE_CHECKING:
    from models.verifier import Verifier

LOOKUP_PRIOR = 0.5  # the continuation rate a run's lookup starts from
LOOKUP_STRENGTH = 4.0  # pseudo-observations a prior rate is worth (the run's against LOOKUP_PRIOR, the prompt's)
TREE_ROOM = 64  # the most nodes a round may verify (eval.engine.decode.TREE_ROOM)


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


class LookupRate:
    """Lookup's continuation rate, measured per prompt and per run: of its chain nodes offered on the accepted path
    (every node whose parent was accepted), the fraction accepted. Beta means: LOOKUP_PRIOR is the run's prior, the
    run's rate the prompt's, each worth LOOKUP_STRENGTH observations."""

    def __init__(self) -> None:
        self.run_hits = self.run_offered = self.hits = self.offered = 0.0

    def new_prompt(self) -> None:
        self.hits = self.offered = 0.0

    def observe(self, hits: int, offered: int) -> None:
        self.run_hits, self.run_offered = self.run_hits + hits, self.run_offered + offered
        self.hits, self.offered = self.hits + hits, self.offered + offered

    @property
    def rate(self) -> float:
        run = (LOOKUP_STRENGTH * LOOKUP_PRIOR + self.run_hits) / (LOOKUP_STRENGTH + self.run_offered)
        return (LOOKUP_STRENGTH * run + self.hits) / (LOOKUP_STRENGTH + self.offered)


def split(lookup: Sequence[float], drafter: Sequence[float], cap: int, ms: Any = None) -> tuple[int, int]:
    """(lookup nodes, drafter nodes) for a round: the best of both value lists (each best first; ties to the
    drafter), as many as maximise (1 + their values) / ms(1 + n) with `ms`, else all that fit `cap` drafts."""
    merged = sorted([(v, 1) for v in drafter] + [(u, 0) for u in lookup], key=lambda x: (-x[0], -x[1]))[:cap]
    best, best_n, total = -1.0, 0, 1.0
    for n in range(len(merged) + 1):
        if n:
            total += merged[n - 1][0]
        score = total / ms(n + 1) if ms is not None else float(n)
        if score > best:
            best, best_n = score, n
    kept = merged[:best_n]
    k = sum(1 for _, src in kept if src == 0)
    return k, best_n - k


class HybridDrafter:
    """`drafter=hybrid`: `primary` (Medusa, EAGLE, a draft model) with `extra`'s tree (prompt lookup) grafted in,
    within `budget` nodes (root included; default the primary's own max_nodes, i.e. the same verifier cost). A
    planned primary (eval.engine.protocol.Planned) has the split chosen each round (module docstring): within
    `budget` when it is given, else within as many nodes as pay."""

    def __init__(self, primary: Drafter, extra: Drafter, budget: int | None = None) -> None:
        if getattr(extra, "reads_hidden", True) and tuple(extra.feature_layers) != tuple(primary.feature_layers):
            raise UserError(f"A hybrid hands both drafters the same verifier features; {type(extra).__name__} reads "
                            f"layers {extra.feature_layers} and {type(primary).__name__} {primary.feature_layers}.")
        if hasattr(extra, "observe") or hasattr(primary, "observe"):
            raise UserError("Lookahead learns from the verifier's outputs on its own nodes and cannot be a hybrid "
                            "part; use prompt_lookup as the grafted drafter.")
        self.extra, self.budget = extra, budget
        self._origin: list[int] = []
        self._chain: list[int] = []  # this round's grafted lookup nodes, in the merged tree
        self.lookup = LookupRate()
        self._expect: tuple[int, int] | None = None
        self._length = 0
        self._prediction = Prediction()
        self.last_split = (0, 0)  # (lookup nodes, drafter nodes) the last round verified, with a planned primary
        self.set_primary(primary)

    def set_primary(self, primary: Drafter) -> None:
        """Draft with `primary` (the planner hands its planned drafter here, eval.adaptive.plan), and size the
        rounds for it: `budget`, else its max_nodes, and with a planned primary room for the chain on top."""
        extra, budget = self.extra, self.budget
        self.primary = primary
        self.feature_layers = primary.feature_layers
        self.max_depth = max(primary.max_depth, extra.max_depth)
        self.max_nodes = primary.max_nodes if budget is None else budget
        if budget is None and isinstance(primary, Planned):
            self.max_nodes = min(primary.max_nodes + extra.max_nodes - 1, TREE_ROOM)
        if self.max_nodes < extra.max_nodes and not isinstance(primary, Planned):
            raise UserError(f"hybrid budget={self.max_nodes} nodes cannot hold the grafted drafter's "
                            f"{extra.max_nodes}; raise drafter.budget or lower its depth.")

    def describe(self) -> dict[str, Any]:
        return {"policy": "hybrid", "max_nodes": self.max_nodes, "max_depth": self.max_depth,
                "split": "per round" if isinstance(self.primary, Planned) else "lookup first",
                "primary": self.primary.describe(), "grafted": self.extra.describe()}

    def round_budget(self) -> int:
        """This round's node budget without a planned primary: `budget`, else the primary's own max_nodes."""
        if self.budget is not None:
            return self.budget
        return int(getattr(self.primary, "planned_nodes", self.primary.max_nodes))

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        # 1. A new decode: the prompt's lookup rate starts from the run's.
        if self._expect != (input_ids.shape[1], hidden.shape[1]):
            self.lookup.new_prompt()
        self._length = input_ids.shape[1]
        # 2. Both sources draft; 3. the split: how many of each this round verifies; 4. graft.
        base = self.primary.propose(input_ids, hidden)
        extra = self.extra.propose(input_ids, hidden)
        if isinstance(self.primary, Planned):
            a, values = self.lookup.rate, self.primary.node_values()
            chain_values = [a ** (i + 1) for i in range(extra.tree.num_drafts)]
            cap = (self.budget or self.max_nodes) - 1
            k, m = split(chain_values, values, cap, None if self.budget else self.primary.round_ms)
            budget = 1 + k + m if self.budget is None else self.budget
            self.last_split = (k, m)
            p = self._prediction
            p.rounds, p.step_ms = p.rounds + 1, self.primary.step_ms
            p.tokens += 1.0 + sum(chain_values[:k]) + sum(values[:m])
            p.ms += self.primary.round_ms(budget)
        else:
            budget = self.round_budget()
            k = min(extra.tree.num_drafts, budget - 1)
        if extra.tree.num_drafts > k:  # the chain's first k tokens
            extra = Draft(tree=chain(k), tokens=extra.tokens[:, : k + 1])
        draft, self._origin = graft(base, extra, budget)
        self._chain = _path_of(draft, extra.tokens[0, 1:].tolist())
        return draft

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Each part is told the count; the nodes in the primary's tree (-1 where a node was grafted), and a primary
        that learns from its rounds (eval.adaptive) which of its nodes were verified. The grafted drafter (prompt
        lookup) is stateless and is told the count alone; the hybrid counts what its chain offered and got."""
        accepted = int(num_accepted[0])
        self._expect = (self._length + accepted + 1, accepted + 1)
        path = nodes[0].tolist()
        hits = 0
        while hits < len(self._chain) and hits < accepted and path[hits + 1] == self._chain[hits]:
            hits += 1
        self.lookup.observe(hits, min(hits + 1, len(self._chain)))
        origin = torch.tensor(self._origin, device=nodes.device)
        if isinstance(self.primary, Planned):
            self.primary.verified_nodes([o for o in self._origin if o >= 0])
        self.primary.accepted(num_accepted, origin[nodes])
        self.extra.accepted(num_accepted, torch.full_like(nodes, -1))

    def prediction(self) -> Prediction | None:
        """What the planner predicted for the decode just finished (a planned primary), else None."""
        if not isinstance(self.primary, Planned):
            return None
        self.primary.prediction()  # its own count (its tree alone) is not what this round verified
        out, self._prediction = self._prediction, Prediction()
        return out

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> list[float] | None:
        """eval.engine.protocol.CostProbe: the primary's (tree.size=auto plans the primary's budget); the grafted prompt
        lookup's string search is left out."""
        return self.primary.draft_cost(verifier, prefix_ids, sizes, engine, reps)


def _path_of(draft: Draft, tokens: list[int]) -> list[int]:
    """The merged nodes of a chain of `tokens` under the root (each the child of the one before with that token)."""
    out, node = [], 0
    children: dict[tuple[int, int], int] = {}
    merged = draft.tokens[0].tolist()
    for i, parent in enumerate(draft.tree.parents[1:], start=1):
        children[(parent, merged[i])] = i
    for token in tokens:
        node = children.get((node, token), -1)
        if node < 0:
            break
        out.append(node)
    return out

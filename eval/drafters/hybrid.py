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
from what each source has been accepting on this prompt, and the round is predicted on the tree it verifies, every
node counted once:
- lookup's chain node i is worth c_1 ... c_i, c_d = P(chain node d accepted | node d-1 accepted), measured per depth,
  apart for nodes the drafter proposed too (`shared`: both sources agree, and are right far more often) and nodes
  only lookup proposed, and per match size (the suffix n-gram lookup matched: a 3-gram's chain is right about three
  times as often as a 1-gram's at its first node). `LookupDepths`: Beta means, the run's counts over all sizes the
  prior of its counts for one size, scaled by how the chains of the prompt's category (where the runner knows it)
  did against those rates, and on this prompt those rates scaled by its chains' hits against what they expected of
  them, every depth, kind and size pooled: a prompt whose chains keep missing prices them near 0 at every depth
  within a few rounds, and the split stops grafting them; one whose chains keep landing prices them up;
- a drafter node is worth what its planner's estimate gives its path (PlannedDrafter.tree_values); one the chain
  shares is counted once, as the chain's; one that leaves the chain at depth d, beside a verified chain node, only
  pays when that chain node is wrong: times 1 - c_d (the two cannot both be right);
- the round's ms: the verifier's forward at the merged tree's size and the drafting (the planner's `round_ms`) plus
  the hybrid's own lookup, split and graft, timed.
The round verifies the n best of both lists, n maximising (1 + their values) / (the round's ms at n + 1 nodes): a
prompt that copies its input gets long lookup chains beside a few drafter nodes, or on top of them, a prompt that
does not gets the drafter's tree alone.

With `sit_out` (drafter.sit_out=true; off by default: measured no better overall, docs/results/planner.md), lookup
drafts first (a string search), and before the drafter runs the round is priced twice: lookup's chain alone
(the verifier's forward over it, no drafting) and the best round with the drafter (its planned nodes at their
planner's values, undiscounted: an upper bound, and the drafting's price). When the chain alone is the better round
the drafter sits it out (eval.engine.protocol.Skippable): no drafter forward, so a round that lookup carries costs
what a lookup round costs. The verifier features of the positions committed meanwhile are held, and the drafter's
next round takes them all in at once (EAGLE and the block drafters extend their caches over them; Medusa reads the
last position only). A decode's first round always drafts (the drafter takes in the prompt).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from eval.drafters.build import export_of, make_drafter
from eval.drafters.lookup import LOOKUP_TOKENS, PromptLookupDrafter, match
from eval.engine.protocol import Draft, Drafter, Observing, Planned, Prediction, Skippable
from eval.engine.timing import RoundOverhead
from eval.engine.tree import Chain, Tree, TreePolicy, chain
from models.exports.io import ExportInfo
from models.verifiers.core import Verifier
from runtime.errors import UserError

if TYPE_CHECKING:
    from models.verifiers.core import Verifier

LOOKUP_PRIOR = 0.5  # the rate a run's lookup starts from at its chain's first node (a deeper one: the one above's)
LOOKUP_STRENGTH = 4.0  # pseudo-observations the run's prior rate is worth against the run's counts
SIZE_STRENGTH = 4.0  # ... the run's rate over all match sizes against the run's counts for one match size
PROMPT_STRENGTH = 16.0  # ... and that, scaled by the prompt's outcomes, against the prompt's counts for one cell
EFFECT_STRENGTH = 4.0  # expected hits (misses) the run's rates are worth against a prompt's own (LookupDepths)
TREE_ROOM = 64  # the most nodes a round may verify (eval.engine.session.TREE_ROOM)


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


class LookupDepths:
    """Lookup's chain, per depth d (0-based), per kind (`shared`: the drafter proposed the same node) and per match
    size n (the suffix n-gram prompt lookup matched: a 3-gram's continuation is right far more often than a
    1-gram's): of the chain nodes offered on the accepted path (their parent accepted), the fraction accepted,
    P(node d | node d-1). The run's rates, two levels, each a Beta mean on the one below:
    - per kind and depth, pooled over match sizes: depth 0 starts from LOOKUP_PRIOR, each deeper depth from the run's
      estimate of the one above (a depth rarely reached moves with the shallower ones), LOOKUP_STRENGTH;
    - per match size, that as its prior, SIZE_STRENGTH;
    where the prompt's category is known (the runner tells it: `category`), scaled by how the chain nodes of that
    category's finished prompts did against what the run's rates expected of them (a translation prompt copies its
    input and a STEM answer does not, and each category's chains keep their own rates); and on this prompt, scaled
    again by how its chain nodes have done against what those rates expected of them, every depth, kind and size
    pooled. Each scaling (`_scaled`): outcomes with fewer hits than expected scale every rate by (EFFECT_STRENGTH +
    the hits) / (EFFECT_STRENGTH + the hits expected); with more, they scale every miss rate, 1 - rate, by
    (EFFECT_STRENGTH + the misses) / (EFFECT_STRENGTH + the misses expected). So a prompt whose chains
    keep missing is priced down at every depth within a few rounds, a run's near-certain 3-gram chains included, and
    one whose chains keep landing is priced up. On top, the prompt's own counts per kind, size and depth, that as
    their prior, PROMPT_STRENGTH: a cell the prompt offers often (its 1-gram chains' first node) moves on its own.
    (The prompt's counts per cell alone, worth 2, left a chain's deeper nodes at the run's rates, each such cell
    seeing a node or two a prompt; replayed on logged chains, this predicts them better, docs/results/planner.md.)"""

    def __init__(self) -> None:
        self.run: dict[bool, dict[int, list[float]]] = {False: {}, True: {}}  # kind -> depth -> [hits, offered]
        self.sized: dict[tuple[bool, int, int], list[float]] = {}  # (kind, size, depth) -> [hits, offered]
        # Per category, over its finished prompts: chain nodes' hits, the hits the run's rates expected, offered
        self.categories: dict[str, list[float]] = {}
        self.category = ""
        self.seen_run = [0.0, 0.0, 0.0]
        self.new_prompt()

    def new_prompt(self, category: str = "") -> None:
        """A new prompt, of `category` ("": none known). The prompt just finished joins its category's outcomes."""
        if self.category and self.seen_run[2]:
            done = self.categories.setdefault(self.category, [0.0, 0.0, 0.0])
            for i, x in enumerate(self.seen_run):
                done[i] += x
        self.category = category
        self.seen = [0.0, 0.0, 0.0]  # this prompt's chain nodes: hits, the hits its category's rates expected, offered
        self.seen_run = [0.0, 0.0, 0.0]  # ... hits, the hits the run's rates expected, offered
        self.prompt: dict[tuple[bool, int, int], list[float]] = {}  # (kind, size, depth) -> [hits, offered]

    def _run_rate(self, depth: int, shared: bool, size: int) -> float:
        run = LOOKUP_PRIOR
        for d in range(depth + 1):
            hits, offered = self.run[shared].get(d, (0.0, 0.0))
            run = (LOOKUP_STRENGTH * run + hits) / (LOOKUP_STRENGTH + offered)
        hits, offered = self.sized.get((shared, size, depth), (0.0, 0.0))
        return (SIZE_STRENGTH * run + hits) / (SIZE_STRENGTH + offered)

    def observe(self, depth: int, shared: bool, hit: bool, size: int = 0) -> None:
        """A chain node of match size `size` offered at `depth` (its parent accepted), and whether it was accepted."""
        run = self._run_rate(depth, shared, size)
        for seen, expected in ((self.seen_run, run), (self.seen, self._category_rate(run))):
            seen[0] += float(hit)
            seen[1] += expected
            seen[2] += 1.0
        for cell in (self.run[shared].setdefault(depth, [0.0, 0.0]),
                     self.sized.setdefault((shared, size, depth), [0.0, 0.0]),
                     self.prompt.setdefault((shared, size, depth), [0.0, 0.0])):
            cell[0] += float(hit)
            cell[1] += 1.0

    def rate(self, depth: int, shared: bool = False, size: int = 0) -> float:
        """P(chain node `depth` accepted | its parent accepted), for a node of this kind and match size, on this
        prompt: the run's rate scaled by the prompt's own outcomes (the class docstring)."""
        scaled = _scaled(self._category_rate(self._run_rate(depth, shared, size)), self.seen)
        hits, offered = self.prompt.get((shared, size, depth), (0.0, 0.0))
        return (PROMPT_STRENGTH * scaled + hits) / (PROMPT_STRENGTH + offered)

    def _category_rate(self, run: float) -> float:
        """The run's rate scaled by how the chains of this prompt's category's finished prompts did against it."""
        done = self.categories.get(self.category) if self.category else None
        return run if done is None else _scaled(run, done)

    def values(self, shared: Sequence[bool], size: int = 0) -> list[float]:
        """A chain's nodes' path-acceptance probabilities, `shared` per node, `size` its match size: the products
        of the depths' rates."""
        out, value = [], 1.0
        for depth, kind in enumerate(shared):
            value *= self.rate(depth, kind, size)
            out.append(value)
        return out


def _scaled(rate: float, seen: Sequence[float]) -> float:
    """`rate` scaled by outcomes `seen` = (hits, the hits `rate` expected of those nodes, nodes offered), worth
    against EFFECT_STRENGTH expected hits (misses): fewer hits than expected scale the rate down, more scale the miss
    rate 1 - rate down (LookupDepths)."""
    hits, expected, offered = seen
    if hits <= expected:
        return rate * (EFFECT_STRENGTH + hits) / (EFFECT_STRENGTH + expected)
    return 1.0 - (1.0 - rate) * (EFFECT_STRENGTH + offered - hits) / (EFFECT_STRENGTH + offered - expected)


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
    `budget` when it is given, else within as many nodes as pay. `sit_out`: the drafter skips the rounds lookup's
    chain carries alone (module docstring)."""

    def __init__(self, primary: Drafter, extra: Drafter, budget: int | None = None, sit_out: bool = False) -> None:
        if getattr(extra, "reads_hidden", True) and tuple(extra.feature_layers) != tuple(primary.feature_layers):
            raise UserError(f"A hybrid hands both drafters the same verifier features; {type(extra).__name__} reads "
                            f"layers {extra.feature_layers} and {type(primary).__name__} {primary.feature_layers}.")
        if isinstance(extra, Observing) or isinstance(primary, Observing):
            raise UserError("Lookahead learns from the verifier's outputs on its own nodes and cannot be a hybrid "
                            "part; use prompt_lookup as the grafted drafter.")
        self.extra, self.budget, self.sit_out = extra, budget, sit_out
        self._origin: list[int] = []
        self._chain: list[int] = []  # this round's grafted lookup nodes, in the merged tree
        self._kinds: list[bool] = []  # per node of that chain: whether the primary proposed it too
        self._size = 0  # the match size of this round's lookup chain (LookupDepths)
        self.lookup = LookupDepths()
        self._category = ""  # the category of the prompts decoded from now on ("": none known), `prompt_category`
        self._own = [0.0, 0.0]  # the hybrid's own ms per round (lookup, split, graft), summed over the run, and rounds
        self._expect: tuple[int, int] | None = None
        self._length = 0
        self._prediction = Prediction()
        self.overhead = RoundOverhead()  # what a round costs beyond its prediction (a planned primary)
        self._round = (0.0, False)  # this round's start (time.perf_counter), and whether it is a decode's first
        self.last_split = (0, 0)  # (lookup nodes, drafter nodes) the last round verified, with a planned primary
        # Over the drafter's life, with a planned primary: drafts predicted and accepted from each part of the tree
        # (lookup: the chain's nodes, shared ones included; drafter: the rest), for the rounds' predicted split
        self.tally = {"lookup": [0.0, 0.0], "drafter": [0.0, 0.0]}
        self._part = (0.0, 0.0)  # this round's prediction: (lookup, drafter)
        self._held: Tensor | None = None  # verifier features of the positions committed while the primary sat out
        self._skipping = False  # this round is lookup's alone (the primary did not draft)
        self._alone_k = 0  # the chain nodes such a round verifies
        self.lookup_rounds = 0  # rounds of lookup's chain alone, over the drafter's life
        self.set_primary(primary)

    branches = True  # lookup chains grafted beside the drafter's: a tree, even within a chain's node count

    def set_primary(self, primary: Drafter) -> None:
        """Draft with `primary` (the planner hands its planned drafter here, eval.planner.adaptive.plan), and size the
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
                "primary": self.primary.describe(), "grafted": self.extra.describe(),
                "lookup_only_rounds": self.lookup_rounds}

    def grafted_alone(self) -> Drafter:
        """eval.engine.protocol.Combination: prompt lookup with this hybrid's chain length and n-gram sizes."""
        return copy.deepcopy(self.extra)

    def round_budget(self) -> int:
        """This round's node budget without a planned primary: `budget`, else the primary's own max_nodes."""
        if self.budget is not None:
            return self.budget
        return int(self.primary.planned_nodes if isinstance(self.primary, Planned) else self.primary.max_nodes)

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        # 1. A new decode: the prompt's lookup rate starts from the run's, and no features are held for the drafter.
        new_decode = self._expect != (input_ids.shape[1], hidden.shape[1])
        if new_decode:
            self.lookup.new_prompt(self._category)
            self._held = None
        self._length = input_ids.shape[1]
        self._skipping = False
        # 2. Lookup drafts (a string search, timed as the hybrid's own work).
        start = time.perf_counter()
        self._round = (start, new_decode)
        extra = self._lookup(input_ids, hidden)
        lookup_s = time.perf_counter() - start
        # 3. A planned primary sits the round out when lookup's chain alone is the better round (module docstring):
        # its forward is saved, and the features of the positions this round commits are held for its next round.
        if self._held is not None:
            hidden = torch.cat([self._held, hidden], dim=1)  # (1, S, D): every position since it last drafted
            self._held = None
        if not new_decode and self._lookup_alone(extra):
            self._held = hidden
            return self._lookup_round(extra, start)
        # 4. The drafter drafts; 5. the split: how many of each this round verifies; 6. graft.
        base = self.primary.propose(input_ids, hidden)
        start = time.perf_counter() - lookup_s  # the hybrid's own work: lookup, split, graft
        if isinstance(self.primary, Planned):
            return self._planned_round(base, extra, start)
        budget = self.round_budget()
        k = min(extra.tree.num_drafts, budget - 1)
        if extra.tree.num_drafts > k:  # the chain's first k tokens
            extra = Draft(tree=chain(k), tokens=extra.tokens[:, : k + 1])
        draft, self._origin = graft(base, extra, budget)
        self._chain = _path_of(draft, extra.tokens[0, 1:].tolist())
        self._kinds = [self._origin[i] >= 0 for i in self._chain]
        return draft

    def _lookup(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        """The grafted drafter's chain, and its match size in `_size`: prompt lookup's search, and the n-gram size
        its chain came from; another grafted drafter's chain has size 0."""
        extra = self.extra
        if not isinstance(extra, PromptLookupDrafter):
            self._size = 0
            return extra.propose(input_ids, hidden)
        found, self._size = match(input_ids[0], extra.num_tokens, extra.max_ngram, extra.min_ngram)
        drafts = torch.tensor([found], dtype=input_ids.dtype, device=input_ids.device).view(1, len(found))
        return Draft(tree=chain(len(found)), tokens=torch.cat([input_ids[:, -1:], drafts], dim=1))  # (1, 1+n)

    def _planned_round(self, base: Draft, extra: Draft, start: float) -> Draft:
        """The split under a planned primary, and the round's prediction on the merged tree (module docstring)."""
        primary: Any = self.primary
        tokens = extra.tokens[0, 1:].tolist()
        on_chain = _path_of(base, tokens)  # the chain's leading nodes the primary proposed too, in its tree
        kinds = [i < len(on_chain) for i in range(len(tokens))]
        chain_values = self.lookup.values(kinds, self._size)
        node_values = primary.tree_values(base.tree)  # per primary draft node, tree order
        leaves = _leaves_chain(base, tokens)  # per primary node: the chain depth where its path leaves the chain
        worth = [0.0] + [_worth(v, leaves[j], kinds, self.lookup, len(tokens), self._size)
                         for j, v in enumerate(node_values)]
        shared = set(on_chain)
        own = self._own[0] / self._own[1] if self._own[1] else 0.0
        cap = (self.budget or self.max_nodes) - 1
        k, m = split(chain_values, [w for j, w in enumerate(worth) if j and j not in shared], cap,
                     None if self.budget else (lambda n: primary.round_ms(n) + own))
        budget = 1 + k + m if self.budget is None else self.budget
        if extra.tree.num_drafts > k:  # the chain's first k tokens
            extra = Draft(tree=chain(k), tokens=extra.tokens[:, : k + 1])
        draft, self._origin = graft(base, extra, budget)
        self._chain, self._kinds = _path_of(draft, tokens[:k]), kinds[:k]
        self.last_split = (k, m)
        # The prediction: every verified node once; a primary node beside a verified chain node as worth it is.
        chain_nodes = set(self._chain)
        rest = sum(_worth(node_values[j - 1], leaves[j - 1], kinds, self.lookup, k, self._size)
                   for node, j in enumerate(self._origin) if node and node not in chain_nodes and j > 0)
        self._part = (sum(chain_values[:k]), rest)
        value = self._part[0] + rest
        spent = 1e3 * (time.perf_counter() - start)
        self._own[0] += spent
        self._own[1] += 1
        self._predict(1.0 + value, primary.round_ms(draft.tree.num_nodes) + own)
        primary.restart_clock()  # the planner times the verify from here: this work is priced above
        return draft

    def _lookup_alone(self, extra: Draft) -> bool:
        """Whether this round verifies lookup's chain alone, decided before the drafter runs: only under a planned
        primary that can sit a round out, and only when lookup's best round beats the best round with the drafter
        even with the drafter's nodes valued as its planner says, none of them discounted for the chain beside them
        (an upper bound on what drafting adds), and the drafting's price paid."""
        primary: Any = self.primary
        if (not self.sit_out or extra.tree.num_drafts == 0
                or not isinstance(primary, Planned) or not isinstance(primary, Skippable)
                or not primary.can_skip):
            return False
        own = self._own[0] / self._own[1] if self._own[1] else 0.0
        chain_values = self.lookup.values([False] * extra.tree.num_drafts, self._size)
        cap = self.max_nodes - 1
        k, _ = split(chain_values, [], cap, lambda n: primary.verify_ms(n) + own)
        alone = (1.0 + sum(chain_values[:k])) / (primary.verify_ms(k + 1) + own)
        drafter_values = primary.coming_values()
        kk, m = split(chain_values, drafter_values, cap, lambda n: primary.round_ms(n) + own)
        merged = sorted(chain_values + drafter_values, reverse=True)[: kk + m]
        both = (1.0 + sum(merged)) / (primary.round_ms(kk + m + 1) + own)
        self._alone_k = k
        return alone > both

    def _lookup_round(self, extra: Draft, start: float) -> Draft:
        """A round of lookup's chain alone (its first `_lookup_alone` nodes), predicted as such: the verifier's
        forward over them and the hybrid's own work, no drafting."""
        primary: Any = self.primary
        k = self._alone_k
        chain_values = self.lookup.values([False] * k, self._size)
        draft = Draft(tree=chain(k), tokens=extra.tokens[:, : k + 1])
        self._origin = [0] + [-1] * k
        self._chain, self._kinds = list(range(1, k + 1)), [False] * k
        self.last_split, self._part, self._skipping = (k, 0), (sum(chain_values), 0.0), True
        self.lookup_rounds += 1
        own = self._own[0] / self._own[1] if self._own[1] else 0.0
        self._own[0] += 1e3 * (time.perf_counter() - start)
        self._own[1] += 1
        self._predict(1.0 + self._part[0], primary.verify_ms(k + 1) + own)
        return draft

    def _predict(self, tokens: float, ms: float) -> None:
        """This round's prediction: E[tokens], and its ms with what rounds have cost beyond their predictions."""
        p = self._prediction
        p.rounds, p.step_ms = p.rounds + 1, self.primary.step_ms  # type: ignore[attr-defined]  # Planned
        p.tokens += tokens
        p.ms += ms + self.overhead.per_round()
        start, first = self._round
        self.overhead.start(ms, start, timed=not first)

    def prompt_category(self, category: str) -> None:
        """The category of the prompt decoded next (the runner's prompt rows carry one): lookup's chains are priced
        on its category's rates (LookupDepths)."""
        self._category = category

    def plain_step(self, ms: float) -> None:
        """The plain step's ms measured on the coming prompt: the prediction's pace (eval.engine.timing)."""
        if isinstance(self.primary, Planned):
            self.overhead.plain_step(ms, self.primary.step_ms)

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Each part is told the count; the nodes in the primary's tree (-1 where a node was grafted), and a primary
        that learns from its rounds (eval.planner.adaptive) which of its nodes were verified. The grafted drafter
        (prompt lookup) is stateless and is told the count alone; the hybrid counts what its chain offered and got. A
        round
        the primary sat out: it is told the positions committed (`skipped`), nothing else."""
        accepted = int(num_accepted[0])
        self._expect = (self._length + accepted + 1, accepted + 1)
        path = nodes[0].tolist()
        hits = 0
        while hits < len(self._chain) and hits < accepted and path[hits + 1] == self._chain[hits]:
            hits += 1
        for depth in range(min(hits + 1, len(self._chain))):  # offered: each chain node whose parent was accepted
            self.lookup.observe(depth, self._kinds[depth], depth < hits, self._size)
        if self._skipping:
            self.tally["lookup"][0] += self._part[0]
            self.tally["lookup"][1] += hits
            self.primary.skipped(accepted + 1)  # type: ignore[attr-defined]  # Skippable, checked when it skipped
            self.extra.accepted(num_accepted, torch.full_like(nodes, -1))
            self.overhead.stop()
            return
        origin = torch.tensor(self._origin, device=nodes.device)
        if isinstance(self.primary, Planned):
            for part, predicted, got in zip(("lookup", "drafter"), self._part, (hits, accepted - hits)):
                self.tally[part][0] += predicted
                self.tally[part][1] += got
            self.primary.verified_nodes([o for o in self._origin if o >= 0])
        self.primary.accepted(num_accepted, origin[nodes])
        self.extra.accepted(num_accepted, torch.full_like(nodes, -1))
        self.overhead.stop()

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


def _leaves_chain(tree_draft: Draft, tokens: list[int]) -> list[int]:
    """Per draft node of `tree_draft` (tree order): the chain depth (0-based) at which its path leaves the chain of
    `tokens`, len(tokens) when it does not (its whole path is on the chain, or deeper than it)."""
    merged, parents = tree_draft.tokens[0].tolist(), tree_draft.tree.parents
    along = [0] * len(parents)  # per node: how many chain tokens its path follows (-1: it left the chain above)
    out: list[int] = []
    for i in range(1, len(parents)):
        d = along[parents[i]]
        if d < 0:
            along[i] = -1
            out.append(out[parents[i] - 1])
        elif d < len(tokens) and merged[i] == tokens[d]:
            along[i] = d + 1
            out.append(len(tokens))
        else:
            along[i] = -1
            out.append(d if d < len(tokens) else len(tokens))
    return out


def _worth(value: float, leaves: int, kinds: Sequence[bool], lookup: LookupDepths, k: int, size: int) -> float:
    """A primary node's value beside the chain's first k nodes: as its planner says, times 1 - c_d where its path
    leaves the chain at depth d < k (there the chain's node is verified, and only one of the two can be right)."""
    if leaves >= k:
        return value
    return value * (1.0 - lookup.rate(leaves, kinds[leaves], size))


# conf/drafter/hybrid.yaml's factory (eval.drafters.build.build_drafter calls it)
def hybrid(verifier: Verifier, tree: TreePolicy, checkpoint: ExportInfo | str | Path | None,
           num_tokens: int | None = None, max_ngram_size: int = 3, min_ngram_size: int = 1,
           budget: int | None = None, sit_out: bool = False, **proposals: Any) -> HybridDrafter:
    """The export's drafter (Medusa / EAGLE, under `tree`) with prompt-lookup chains of up to `num_tokens` grafted
    in, within `budget` nodes (null: the export drafter's own node count). num_tokens null: as long as prompt
    lookup's own chain (LOOKUP_TOKENS), or what the budget holds beside the root when that is less. `sit_out`: the
    drafter skips the rounds lookup's chain carries alone (eval.drafters.hybrid)."""
    if (num_tokens is not None and num_tokens < 1) or (budget is not None and budget < 2):
        what = f"drafter.num_tokens={num_tokens}" if budget is None or budget >= 2 else f"drafter.budget={budget}"
        raise UserError(f"drafter=hybrid verifies prompt-lookup chains beside the export's drafts, and {what} leaves "
                        f"no lookup source usable (no token of a chain can be verified: a chain needs num_tokens "
                        f">= 1 and a node beside the root, budget >= 2). Give drafter.num_tokens >= 1 (null: "
                        f"{LOOKUP_TOKENS}) and drafter.budget >= 2 (null: the export drafter's own), or run the "
                        f"export's drafter alone (drafter=export).")
    primary = make_drafter(None, verifier, tree, checkpoint=export_of(checkpoint, "hybrid"), **proposals)
    if num_tokens is None:
        num_tokens = max(min(LOOKUP_TOKENS, (primary.max_nodes if budget is None else budget) - 1), 1)
    return HybridDrafter(primary, PromptLookupDrafter(Chain(num_tokens), num_tokens, max_ngram_size, min_ngram_size),
                         budget, sit_out=bool(sit_out))

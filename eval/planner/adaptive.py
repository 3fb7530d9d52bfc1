"""Planning from the acceptance the run measures (`plan=adaptive`, the default under `tree.size=auto`).

The static planner (eval.planner.cost.auto_size) chooses a budget once, from the export's training-time acceptance table
(ExportInfo.acceptance: per depth, cumulative top-k accuracy). On prompts no one trained on that table is optimistic,
and the planner promised more speedup than came. Here the table is only where the estimate starts:

- `AcceptanceEstimate` keeps, per depth and per rank, how often the rank was offered and how often it was the
  accepted one, counted over the run and over the current prompt. Each round observes, at every depth its accepted
  path reached, which ranks the tree offered under the last accepted node and which of them was accepted (or none);
  nodes off that path say nothing and are not counted. The estimate is a Beta posterior mean twice over: the export's
  table is the run's prior (RUN_PRIOR pseudo-observations a cell), the run's estimate the prompt's (PROMPT_PRIOR).
  A cell never offered moves with the cells of its depth that were (their posterior over their prior), and a depth
  never reached with the one above it, so a table found too optimistic at depth 1 stops promising deep nodes too.
- `PlannedDrafter` wraps the drafter tree.size=auto built. Before every round it predicts the round (E[tokens] under
  the estimate so far, and verify + draft ms from the run's curves: no extra verifier forward, nothing measured after
  the fact), and with `adaptive` re-plans when the estimate has moved: the budget maximising E[tokens](s) / (t(s+1) +
  c d(s)) (eval.planner.cost's rule, on the estimate in place of the table; c the drafting's measured time over the
  draft curve's, against the same ratio for the rest of the round: the curves are timed once, on one prefix, and a
  loaded machine or a real prompt's drafting may cost more), then a fixed tree rebuilt by auto_tree at that
  budget (Medusa, P-EAGLE, DFlash: their `set_tree`) or an EAGLE budget (`size`, and the depth that budget's tree
  reaches). `prediction()` hands the runner what it predicted for the decode just finished, so the report shows
  predicted beside measured speedup per prompt, category and method.

Exactness is the decode loop's: whatever tree a round drafts, greedy acceptance keeps plain greedy's tokens, and the
tree of a round is fixed before its drafts are made, from earlier rounds only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from eval.engine.protocol import BuiltOn, Draft, Drafter, Prediction, Skippable
from eval.engine.timing import RoundOverhead
from eval.engine.tree import AutoTree, Chain, DynamicTree, Tree, rank_probs
from eval.planner import cost
from eval.planner.shapes import TreeShape, shape_named, shape_of
from models.exports.io import ExportInfo
from models.families import FAMILIES
from runtime.errors import UserError

TIME_PRIOR = 5.0  # rounds' worth of trust in the curves' own times before measured ones move them
# Pseudo-observations the export's table is worth in each (depth, rank) cell against the run's counts, and the run's
# estimate against the current prompt's. Lighter priors (8 and 4) chased a few rounds' luck: on the eval split the
# re-planned trees gave Medusa and DFlash 6-7% fewer tokens per modelled ms than the static plan
# (docs/results/planner.md).
RUN_PRIOR = 64.0
PROMPT_PRIOR = 16.0
MOVED = 0.02  # re-plan when a cell's estimate moved by more than this (absolute probability) since the last plan


def _posterior(prior: list[list[float]], hits: list[list[float]], offered: list[list[float]],
               strength: float) -> list[list[float]]:
    """Per (depth, rank): the Beta posterior mean (strength * prior + hits) / (strength + offered). A cell never
    offered takes its prior times the ratio its depth's offered cells moved by (a depth with none: the ratio above
    it); a depth's ranks are kept to a total of at most 1 (one token is the right one)."""
    out, ratio = [], 1.0
    for row, hit, off in zip(prior, hits, offered):
        post = [(strength * p + h) / (strength + n) for p, h, n in zip(row, hit, off)]
        seen = sum(p for p, n in zip(row, off) if n)
        if seen > 0:
            ratio = sum(q for q, n in zip(post, off) if n) / seen
        post = [q if n else p * ratio for p, q, n in zip(row, post, off)]
        total = sum(post)
        out.append([q / total for q in post] if total > 1.0 else post)
    return out


class AcceptanceEstimate:
    """Per-depth, per-rank acceptance measured on the prompts being decoded, the export's table as the prior."""

    def __init__(self, table: Sequence[Sequence[float]]) -> None:
        self.prior = rank_probs(table)
        shape = [len(row) for row in self.prior]
        self._zeros = lambda: [[0.0] * w for w in shape]
        self.run_hits, self.run_offered = self._zeros(), self._zeros()
        self.new_prompt()

    def new_prompt(self) -> None:
        """Forget the last prompt's counts (the run keeps them)."""
        self.hits, self.offered = self._zeros(), self._zeros()

    def observe(self, depth: int, offered: Sequence[int], accepted: int | None) -> None:
        """At `depth` (0-based: the first draft is depth 0) the tree offered `offered` ranks under an accepted node;
        `accepted` the one the verifier took, None when none was. Ranks or depths past the table are not counted."""
        if depth >= len(self.prior):
            return
        width = len(self.prior[depth])
        for rank in offered:
            if rank < width:
                hit = float(rank == accepted)
                for hits, off in ((self.run_hits, self.run_offered), (self.hits, self.offered)):
                    hits[depth][rank] += hit
                    off[depth][rank] += 1.0

    def probs(self) -> list[list[float]]:
        """P(rank r is the right token at depth d), the prompt's estimate: the table -> the run -> this prompt."""
        run = _posterior(self.prior, self.run_hits, self.run_offered, RUN_PRIOR)
        return _posterior(run, self.hits, self.offered, PROMPT_PRIOR)

    def table(self) -> list[list[float]]:
        """`probs` as a cumulative top-k table, the form eval.engine.tree.auto_tree and eval.planner.cost read."""
        return [[min(sum(row[: r + 1]), 1.0) for r in range(len(row))] for row in self.probs()]


class PlannedDrafter:
    """A drafter tree.size=auto planned, predicted round by round and, with `adaptive`, re-planned from the
    acceptance the run measures (module docstring). Keeps the drafter protocol (eval.engine.protocol.Drafter).

    kind: the shape of the family's drafts (eval.planner.shapes: "fixed", a FixedTreeDrafter with `set_tree` and
    `depth_limit`; "dynamic", a BudgetDrafter: `size` and `depth`), or its registry name. curve / draft: the
    verifier's cost curve and the drafter's draft curve (ms at curve.sizes, or None) the static plan was made on.
    size: that plan's budget. An adaptive drafter is built at the largest budget (eval.planner.cost.PROBE_SIZE), so
    its depth is the deepest any budget may reach, and it declares that budget and depth to the decode loop
    (`max_nodes`, `max_depth`: the cache is sized for them).
    learn_times: whether measured round times move the drafting's price (`draft_scale`); False plans on the curves
    alone."""

    def __init__(self, drafter: Any, table: Sequence[Sequence[float]], kind: TreeShape | str, curve: cost.Curve,
                 draft: Sequence[float] | None, size: int, adaptive: bool, min_drafts: int = 0,
                 max_drafts: int = cost.PROBE_SIZE, learn_times: bool = True) -> None:
        self.inner, self.shape, self.adaptive = drafter, shape_named(kind), adaptive
        self.feature_layers = drafter.feature_layers
        limit = self.shape.depth_limit(drafter)
        self.table = [list(row) for row in table[:limit]]
        self.estimate = AcceptanceEstimate(self.table)
        ms = cost.monotone(curve.ms)
        spent = None if draft is None else cost.monotone(draft)
        # The floor of a re-plan: a run whose static plan drafts keeps drafting at least one node. At zero drafts
        # nothing is offered, so nothing is observed, and an estimate that fell on a hard stretch could never rise
        # again for the rest of the run (DFlash on unseen prompts planned itself to 0 drafts within a few rounds).
        # Switching drafting off is the static plan's call, made on the export's table.
        self.min_drafts, self.max_drafts = max(min_drafts, 1 if size > 0 else 0), max_drafts
        self._plans = [cost.plan_monotone(curve.sizes, ms, 1.0, s, spent) for s in range(max_drafts + 1)]
        self.step_ms = self._plans[0].step_ms
        self._base_depth = limit  # the deepest a re-planned budget may grow (its shape's limit)
        if adaptive:
            self.max_nodes, self.max_depth = 1 + max_drafts, len(self.table)
        else:
            self.max_nodes, self.max_depth = drafter.max_nodes, drafter.max_depth
        self.size = -1
        self._resize(size, self.table)
        self._planned = self.estimate.probs()
        self._tree: Tree | None = None
        self._length = 0
        self._expect: tuple[int, int] | None = None  # (tokens, hidden positions) the next round of this decode brings
        self._verified: set[int] | None = None
        self._round_values: list[float] = []
        self._prediction = Prediction(step_ms=self.step_ms)
        # measured against predicted ms, drafting and the rest of the round (verify, accept, commit), this run; the
        # curves' own times as the prior, TIME_PRIOR rounds of them
        d0, v0 = max(self._plans[size].draft_ms, 1e-3), self._plans[size].verify_ms
        self._times = [TIME_PRIOR * d0, TIME_PRIOR * d0, TIME_PRIOR * v0, TIME_PRIOR * v0]
        # a drafter whose drafting is not timed is planned as free; learn_times=False keeps the curves' own times
        # (a plan that depends on acceptance alone: the tests that compare plans by it)
        self._timed = adaptive and draft is not None and learn_times
        self._predicted = (0.0, 0.0)  # this round's predicted draft and verify ms
        self.overhead = RoundOverhead()  # what a round costs beyond the curves, for the prediction
        self._clock, self._draft_ms = 0.0, 0.0
        self._time_round = False  # whether this round's times are evidence on the curves (`_timed_round`)
        self.timed_rounds = 0  # rounds whose measured times moved `draft_scale`, over the drafter's life
        self._catching_up = False  # the coming round takes in the positions of rounds it sat out (`skipped`)

    @property
    def draft_scale(self) -> float:
        """How much more (or less) drafting costs than the draft curve says, relative to the rest of the round
        against the cost curve (1 until rounds are measured; static plans keep 1: their prediction is the table's;
        so does a drafter without a draft curve, planned as free)."""
        if not self._timed:
            return 1.0
        d_measured, d_predicted, r_measured, r_predicted = self._times
        return (d_measured / d_predicted) / (r_measured / r_predicted)

    def _timed_round(self, new_decode: bool) -> bool:
        """Whether a round's measured times say how drafting compares with its curve. Not the first round of a
        decode: the drafter then takes in the whole prompt (EAGLE's and DFlash's context caches), a prefill the draft
        curve, timed in steady state, never priced. Not a round planned with no drafts: the curve has no time for
        it (a drafter still takes in the new positions), and counting those rounds against a predicted 0 ms would
        make drafting look dearer each round until no budget paid. Not a round after rounds it sat out (`skipped`):
        it takes in all their positions."""
        return self._timed and not new_decode and self.size > 0 and not self._catching_up

    def observe_times(self, draft_ms: float, rest_ms: float) -> None:
        """A timed round: its drafting and the rest of it (verify, accept, commit), measured, each beside what the
        plan predicted for it (`draft_scale` reads the four sums)."""
        self._times[0] += draft_ms
        self._times[1] += self._predicted[0]
        self._times[2] += rest_ms
        self._times[3] += self._predicted[1]

    # -- the plan -------------------------------------------------------------------------------------------------
    def _resize(self, size: int, table: list[list[float]], changed: bool = True) -> None:
        """Draft `size` drafts from the next round on, the tree `table` buys for them (its shape says how)."""
        self.size = size
        self.shape.resize(self.inner, size, table, self.adaptive, self._base_depth, changed)

    def _replan(self) -> None:
        """1. The estimate's table; 2. if it moved since the last plan, the budget eval.planner.cost's rule picks on
        it, and the drafter resized when the budget or the tree changed."""
        probs = self.estimate.probs()
        if max(abs(a - b) for r, s in zip(probs, self._planned) for a, b in zip(r, s)) <= MOVED:
            return
        self._planned = probs
        table = self.estimate.table()
        expected = cost.expected_curve(table, self.max_drafts)
        scale = self.draft_scale
        best = max(range(self.min_drafts, self.max_drafts + 1),
                   key=lambda s: (expected[s] / (self._plans[s].verify_ms + scale * self._plans[s].draft_ms), -s))
        self._resize(best, table, changed=best != self.size)

    def _values(self) -> list[float]:
        """The coming round's drafts' path-acceptance probabilities under the estimate so far, best first."""
        table = self.estimate.table() if self.adaptive else self.table
        return self.shape.values(self.inner, table, self.size)

    def tree_values(self, tree: Tree) -> list[float]:
        """Each draft node of `tree` (a round this drafter proposed, in tree order): its path-acceptance probability
        under the estimate so far (static: the table), from its (depth, rank) path. A hybrid prices the nodes it
        keeps with these (eval.drafters.hybrid)."""
        return cost.tree_values(tree, self.estimate.table() if self.adaptive else self.table)

    def restart_clock(self) -> None:
        """The caller's own work since `propose` returned is not the round's verify: a hybrid's lookup and graft,
        which it times and prices itself (eval.drafters.hybrid)."""
        self._clock = time.perf_counter()

    @property
    def planned_nodes(self) -> int:
        """The nodes the coming (or just proposed) round drafts, root included."""
        return 1 + self.size

    def node_values(self) -> list[float]:
        """eval.engine.protocol.Planned: the round just proposed, its drafts' predicted values, best first."""
        return self._round_values

    def round_ms(self, nodes: int) -> float:
        """eval.engine.protocol.Planned: the verifier's forward over `nodes` nodes and this plan's drafting (as
        measured so far against the curves: `draft_scale`), in the cost curve's ms."""
        verify = self._plans[min(max(nodes - 1, 0), self.max_drafts)].verify_ms
        return verify + self.draft_scale * self._plans[self.size].draft_ms

    def verify_ms(self, nodes: int) -> float:
        """The verifier's forward over `nodes` nodes alone (a round that runs no drafting: a hybrid's lookup-only)."""
        return self._plans[min(max(nodes - 1, 0), self.max_drafts)].verify_ms

    def coming_values(self) -> list[float]:
        """The next round's drafts' predicted values, best first, before it drafts (re-planned first, as `propose`
        does): what a hybrid weighs against lookup's chain to decide whether the drafter runs at all. A decode's
        first round is `propose`'s to plan."""
        if self.adaptive:
            self._replan()
        return self._values()

    @property
    def can_skip(self) -> bool:
        """Whether the planned drafter can sit a round out (eval.engine.protocol.Skippable)."""
        return isinstance(self.inner, Skippable)

    def skipped(self, positions: int) -> None:
        """eval.engine.protocol.Skippable: a round without this drafter committed `positions` positions; the next
        `propose` continues the decode with their features too."""
        if self._expect is not None:
            self._expect = (self._expect[0] + positions, self._expect[1] + positions)
        self._catching_up = True
        self.inner.skipped(positions)

    # -- the drafter protocol ---------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        inner = self.inner.describe()
        if not self.adaptive:
            return {**inner, "plan": "static"}
        return {**inner, "policy": "adaptive", "plan": "adaptive", "max_nodes": self.max_nodes,
                "planned_drafts": self.size}

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        start = time.perf_counter()  # the planner's own work counts as drafting
        # 1. A new decode (not the continuation the last round announced): the prompt's counts start from the run's.
        new_decode = self._expect != (input_ids.shape[1], hidden.shape[1])
        if new_decode:
            self.estimate.new_prompt()
            self._planned = [[-1.0]]  # re-plan for the new prompt from the run's estimate
        # 2. Re-plan on the estimate so far; 3. predict this round before it runs; 4. draft.
        if self.adaptive:
            self._replan()
        p = self._prediction
        p.rounds += 1
        predicted = self.round_ms(self.planned_nodes)
        p.ms += predicted + self.overhead.per_round()
        self.overhead.start(predicted, start, timed=not new_decode)
        self._predicted = (self._plans[self.size].draft_ms, self._plans[self.size].verify_ms)
        self._time_round = self._timed_round(new_decode)
        self._catching_up = False
        draft = self.inner.propose(input_ids, hidden)
        self._tree, self._length = draft.tree, input_ids.shape[1]
        # The round's E[tokens] on the tree drafted, before it is verified: a dynamic drafter (EAGLE) grows its own
        # best-first tree by its scores, not the one the table would grow, and the table's tree promised more.
        self._round_values = sorted(self.tree_values(draft.tree), reverse=True)
        p.tokens += 1.0 + sum(self._round_values)
        self._clock = time.perf_counter()
        self._draft_ms = 1e3 * (self._clock - start)
        return draft

    def verified_nodes(self, nodes: Sequence[int]) -> None:
        """Told by a hybrid before `accepted`: the nodes of this drafter's last tree that were verified (the rest
        were dropped to make room for grafted ones and say nothing about acceptance)."""
        self._verified = set(nodes)

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Observe the round, then tell the drafter. `nodes` (1, 1+A) in this drafter's tree; -1 where the path
        took a node this drafter did not propose (a hybrid's grafted one): its offered children there all missed."""
        accepted = int(num_accepted[0])
        if self._time_round:  # the rest of the round: verify, accept, commit (a hybrid: its graft)
            self.observe_times(self._draft_ms, 1e3 * (time.perf_counter() - self._clock))
            self.timed_rounds += 1
        self._expect = (self._length + accepted + 1, accepted + 1)
        if self.adaptive and self._tree is not None:
            self._observe(self._tree, nodes[0].tolist(), accepted)
        self._verified = None
        self.inner.accepted(num_accepted, nodes)
        self.overhead.stop()

    def plain_step(self, ms: float) -> None:
        """The plain step's ms measured on the coming prompt (the runner's plain decode of it): the prediction's pace
        (eval.engine.timing.RoundOverhead)."""
        self.overhead.plain_step(ms, self.step_ms)

    def _observe(self, tree: Tree, path: list[int], accepted: int) -> None:
        """At each depth the accepted path reached inside this tree: the ranks offered there and the one taken."""
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(tree.parents[1:], start=1):
            if self._verified is None or i in self._verified:
                children.setdefault(parent, []).append(i)
        for d in range(len(path)):
            node = path[d]
            kids = children.get(node, []) if node >= 0 else []
            if not kids:
                return
            nxt = path[d + 1] if d + 1 <= accepted and d + 1 < len(path) else -1
            self.estimate.observe(d, [tree.ranks[c] for c in kids], tree.ranks[nxt] if nxt >= 0 else None)
            if nxt < 0:
                return

    def prediction(self) -> Prediction:
        """What was predicted for the decode just finished (each round before it ran); starts the next count."""
        out, self._prediction = self._prediction, Prediction(step_ms=self.step_ms)
        return out

    def draft_cost(self, verifier: Any, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> list[float] | None:
        """eval.engine.protocol.CostProbe: the wrapped drafter's."""
        return self.inner.draft_cost(verifier, prefix_ids, sizes, engine, reps)


PLANS = ("adaptive", "static")


def _fixed_by(tree: Any) -> str | None:
    """How a tree policy fixes the tree, as the command line wrote it; None for tree.size=auto."""
    if isinstance(tree, AutoTree):
        return None if tree.size == "auto" else f"tree.size={tree.size}"
    names = {Chain: "tree=chain", DynamicTree: "tree=dynamic", Tree: "tree=medusa_choices"}
    return names.get(type(tree), f"tree={type(tree).__name__}")


def plan_mode(value: Any, tree: Any, family: str, export: ExportInfo | None, strict: bool = True) -> bool:
    """Whether the run re-plans from measured acceptance: `plan` null (the default) adapts under tree.size=auto
    wherever the budget is planned at all, `static` never; `adaptive` refuses a run with nothing to adapt (a fixed
    tree, a family that drafts its own chain, an export without its acceptance table). `strict` False (method=all):
    the families with nothing to plan are left as they are."""
    if value is not None and str(value) not in PLANS:
        raise UserError(f"plan={value!r} is not a plan; use plan=adaptive (re-plan the tree.size=auto budget from the "
                        f"acceptance measured while decoding), plan=static (the budget planned once, from the "
                        f"export's table) or leave it out (adaptive under tree.size=auto).")
    fixed = _fixed_by(tree)
    plannable = (shape_of(family).plans and export is not None and export.acceptance is not None)
    if value is None:
        return fixed is None and plannable
    if str(value) == "static":
        return False
    if fixed is not None:
        raise UserError(f"plan=adaptive re-plans the tree.size=auto budget between rounds, but this run fixes the "
                        f"tree ({fixed}). Give tree.size=auto (the default tree=auto) to let the planner choose and "
                        f"adapt it, or drop plan=adaptive to keep the tree you gave.")
    if not shape_of(family).plans:
        if not strict:
            return False
        raise UserError(f"plan=adaptive plans the tree of an export's drafter, and drafter={family} drafts its own "
                        f"chain (its drafter.* options); drop plan=adaptive, or run an export "
                        f"(python -m eval checkpoint=<export> plan=adaptive).")
    if export is None or export.acceptance is None:
        need = " or ".join(FAMILIES[export.kind].acceptance) if export is not None else "an acceptance table"
        raise UserError(f"plan=adaptive starts from the export's acceptance table ({need} in its config.json), and "
                        f"this export has none; re-export it with a current train.py, or drop plan=adaptive (it then "
                        f"drafts {cost.FALLBACK_SIZE} nodes).")
    return True


def plan(drafter: Any, kind: TreeShape | str, table: Sequence[Sequence[float]], curve: cost.Curve,
         draft: Sequence[float] | None, size: int, adaptive: bool, min_drafts: int = 0) -> Drafter:
    """The drafter under the planner: a drafter of an export family wrapped in a PlannedDrafter; a drafter built
    around one (the hybrid: its `primary`) with that one wrapped in place, its budget then the plan's."""
    if isinstance(drafter, BuiltOn):
        drafter.set_primary(PlannedDrafter(drafter.primary, table, kind, curve, draft, size, adaptive, min_drafts))
        return drafter
    return PlannedDrafter(drafter, table, kind, curve, draft, size, adaptive, min_drafts)

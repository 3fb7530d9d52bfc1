"""How a family's drafts take their shape, as a strategy the planner and the harness call instead of branching on the
registry's `tree` name (models/families.py: "fixed", "dynamic", "primary", "own").

- fixed (Medusa, P-EAGLE, DFlash, DSpark): one tree every round, which the planner sets (`set_tree`), as deep as the
  drafter drafts in one forward (`depth_limit`);
- dynamic (EAGLE-1/3): a budget of `size` nodes grown each round, no deeper than `depth`;
- primary (the hybrid): a combination planned through the export's drafter it is built on;
- own (prompt lookup, lookahead, a draft model): the family's own options shape its drafts; nothing to plan.

A new shape is one class here (or in its own module) and one `register` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

from eval.engine.protocol import BudgetDrafter, FixedTreeDrafter
from eval.engine.tree import AutoTree, auto_tree, best_first
from eval.planner import cost
from models.exports.io import ExportInfo
from models.families import FAMILIES


class TreeShape(Protocol):
    """name: its registry name. plans: tree.size=auto plans its budget from an acceptance table. combines: a
    combination built on the export's drafter (the report decodes that drafter alone beside it). warns: a budget
    that cannot be planned (no acceptance table) falls back with a message rather than silently."""

    name: str
    plans: bool
    combines: bool
    warns: bool

    def depth_limit(self, drafter: Any) -> int:
        """The deepest tree the drafter drafts: the planner's table is cut to it."""
        ...

    def resize(self, drafter: Any, size: int, table: list[list[float]], adaptive: bool, base_depth: int,
               changed: bool) -> None:
        """Draft `size` drafts from the next round on, as the table says they are best spent (`changed`: the
        budget moved; a fixed tree is rebuilt when the table moved alone)."""
        ...

    def values(self, drafter: Any, table: list[list[float]], size: int) -> list[float]:
        """The coming round's drafts' path-acceptance probabilities under `table`, best first."""
        ...

    def predict(self, drafter: Any, curve: cost.Curve, table: Sequence[Sequence[float]],
                draft: Sequence[float] | None) -> cost.Plan:
        """What the verifier's cost curve predicts for the drafter as built."""
        ...


class Fixed:
    name, plans, combines, warns = "fixed", True, False, False

    def depth_limit(self, drafter: Any) -> int:
        return int(drafter.depth_limit)

    def resize(self, drafter: Any, size: int, table: list[list[float]], adaptive: bool, base_depth: int,
               changed: bool) -> None:
        drafter.set_tree(auto_tree(table, size))

    def values(self, drafter: Any, table: list[list[float]], size: int) -> list[float]:
        return sorted(cost.tree_values(drafter.tree, table), reverse=True)

    def predict(self, drafter: Any, curve: cost.Curve, table: Sequence[Sequence[float]],
                draft: Sequence[float] | None) -> cost.Plan:
        tree = cast(FixedTreeDrafter, drafter).tree
        return cost.plan(curve.sizes, curve.ms, 1.0 + sum(cost.tree_values(tree, table)), tree.num_drafts, draft)


class Dynamic:
    name, plans, combines, warns = "dynamic", True, False, True

    def depth_limit(self, drafter: Any) -> int:
        return int(drafter.depth)

    def resize(self, drafter: Any, size: int, table: list[list[float]], adaptive: bool, base_depth: int,
               changed: bool) -> None:
        if changed and adaptive:  # grown each round, no deeper than the tree the plan priced
            drafter.size = size
            drafter.depth = min(base_depth, auto_tree(table, size).max_depth) if size else base_depth

    def values(self, drafter: Any, table: list[list[float]], size: int) -> list[float]:
        return best_first(table, size)[1]

    def predict(self, drafter: Any, curve: cost.Curve, table: Sequence[Sequence[float]],
                draft: Sequence[float] | None) -> cost.Plan:
        size = cast(BudgetDrafter, drafter).size
        return cost.plan(curve.sizes, curve.ms, cost.expected_tokens(table, size), size, draft)


class Primary(Dynamic):
    """A combination's shape is its primary's (the export's drafter): planned through it."""

    name, plans, combines, warns = "primary", True, True, True


class Own(Dynamic):
    """The family's own options shape its drafts; tree.size=auto leaves it as it is."""

    name, plans, combines, warns = "own", False, False, False


SHAPES: dict[str, TreeShape] = {}


def register(shape: TreeShape) -> TreeShape:
    SHAPES[shape.name] = shape
    return shape


for _shape in (Fixed(), Dynamic(), Primary(), Own()):
    register(_shape)


def shape_named(name: str | TreeShape) -> TreeShape:
    """The shape a registry `tree` value names (a shape passes through)."""
    return name if not isinstance(name, str) else SHAPES[name]


def shape_of(family: str) -> TreeShape:
    """The shape of `family`'s drafts, from its registry entry."""
    return SHAPES[FAMILIES[family].tree]


def predict(export: ExportInfo, drafter: Any, curve: cost.Curve, draft: Sequence[float] | None = None
            ) -> cost.Plan | None:
    """What the curve predicts for the drafter as built, or None without acceptance estimates: its family's shape
    scores it (a fixed tree on its `tree`, a budget on the best tree of its `size` under the table)."""
    if export.acceptance is None:
        return None
    return shape_of(export.kind).predict(drafter, curve, export.acceptance, draft)


def budget_policy(policy: Any, family: str, export: ExportInfo | None) -> tuple[Any, bool]:
    """The tree policy a run drafts under and whether its budget is to be planned (tree.size=auto). tree.size=auto is
    the default, so it must not fail where the budget cannot be planned: families whose own options shape their
    drafts (prompt lookup, lookahead, a draft model) ignore it, and an EAGLE export (or a hybrid on one) older than
    its acceptance table drafts FALLBACK_SIZE nodes (a Medusa one cannot build a tree=auto at all: its drafter says
    so)."""
    auto = isinstance(policy, AutoTree) and policy.size == "auto"
    shape = shape_of(family)
    if auto and (export is None or export.acceptance is None or not shape.plans):
        if export is not None and shape.warns:
            print(f"[eval] tree.size=auto: this export records no acceptance estimates (medusa_topk_accuracy, or "
                  f"eagle_topk_accuracy / val_step_top1): no validation of its final weights wrote them. "
                  f"It drafts {cost.FALLBACK_SIZE} nodes; give tree.size=N to choose, or write them: "
                  f"{cost.VALIDATE_EXPORT}.")
        return AutoTree(size=cost.FALLBACK_SIZE), False
    return policy, auto

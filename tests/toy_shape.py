"""A toy tree shape defined outside the package, to show that adding a shape is one module plus its registration
(eval.planner.shapes): `chain_only` is a fixed shape whose planner spends every budget on one chain (as deep as the
drafter drafts), never on siblings."""

from __future__ import annotations

from typing import Any

from eval.engine.tree import chain
from eval.planner.shapes import Fixed, register


class ChainOnly(Fixed):
    name = "chain_only"

    def resize(self, drafter: Any, size: int, table: list[list[float]], adaptive: bool, base_depth: int,
               changed: bool) -> None:
        drafter.set_tree(chain(min(size, self.depth_limit(drafter))))


register(ChainOnly())

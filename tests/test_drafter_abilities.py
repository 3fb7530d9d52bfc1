"""A drafter's optional abilities are declared protocols (eval/engine/protocol.py) that the decode loop, the runner and
the planner check with isinstance, never by probing an attribute's name: what a drafter offers is read from its
class, and the runner asks it without importing the planner.
"""

from __future__ import annotations

import ast

from eval.drafters.hybrid import HybridDrafter
from eval.drafters.lookahead import LookaheadDrafter
from eval.drafters.lookup import PromptLookupDrafter
from eval.engine.protocol import Branching, BuiltOn, CategoryPriced, Drafter, Observing, Paced, Planned, Skippable
from eval.engine.tree import Chain
from eval.planner.adaptive import PlannedDrafter
from helpers import ROOT


def test_each_drafter_offers_the_abilities_its_class_declares():
    lookup = PromptLookupDrafter(Chain(4), 4)
    hybrid = HybridDrafter(PromptLookupDrafter(Chain(4), 4), PromptLookupDrafter(Chain(4), 4))
    assert isinstance(hybrid, Drafter) and isinstance(lookup, Drafter)
    # the hybrid: built on its primary, priced per category, paced by the plain step, branching
    assert isinstance(hybrid, BuiltOn) and hybrid.primary is not None
    assert isinstance(hybrid, CategoryPriced) and isinstance(hybrid, Paced) and isinstance(hybrid, Branching)
    assert hybrid.branches is True
    # a planned drafter: paced, priced round by round, and (for a Skippable inner drafter) able to sit out
    assert issubclass(PlannedDrafter, Paced) and issubclass(PlannedDrafter, Skippable)
    assert {"planned_nodes", "can_skip", "node_values", "round_ms", "prediction"} <= set(dir(PlannedDrafter))
    assert issubclass(LookaheadDrafter, Observing)
    # prompt lookup offers none of them: the loop and the runner leave it alone
    for ability in (BuiltOn, Branching, CategoryPriced, Paced, Observing, Planned):
        assert not isinstance(lookup, ability), ability.__name__


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_runner_and_the_decode_loop_ask_the_drafter_not_the_planner():
    for path in (ROOT / "eval" / "runner.py", ROOT / "eval" / "engine" / "decode.py"):
        assert not any(m.startswith("eval.planner") for m in _imports(path)), path


def test_no_optional_ability_is_found_by_its_name():
    """getattr(drafter, "plain_step") and the like: each such probe is an isinstance of a protocol now."""
    names = {"observe", "branches", "can_skip", "primary", "planned_nodes", "prediction", "prompt_category",
             "plain_step"}
    found = []
    for path in sorted((ROOT / "eval").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert not found, found

"""The drafter protocol: what every drafter implements, and the Draft it returns. The decode loop never asks which
drafter it holds (eval.drafters.build builds one from an export, eval.drafters.build from a config).

Each round the loop hands a drafter M_p what the verifier M_q just produced: all tokens so far, whose last one is
the root of the next tree (chosen by the acceptance rule, not yet in M_q's cache), and M_q's hidden states at the
positions it just committed (the prompt after prefill, the accepted path after a round), of the layers the drafter
declared in `feature_layers`. The drafter owns the shape of what it proposes (its tree policy, eval.engine.tree) and
fills that tree with tokens. After verification it is told how many drafts were accepted, and on which nodes, so that a
drafter with its own KV cache (EAGLE, a draft model) can roll it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor, nn

from eval.engine.tree import Tree

if TYPE_CHECKING:
    from models.verifiers.core import Verifier


@dataclass
class Draft:
    """One round's proposal: the tree it fills (fixed, or grown this round) and a token per node, (B, N);
    node 0 is the root. p: (B, N, V) the warped distribution each node's token was drawn from (row 0 unused), when
    the drafter sampled its proposals; None for deterministic (top-k) drafts, which the sampling rule treats as
    one-hot p (eval.engine.sampling)."""

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


# -- what the planner (eval.planner.cost: tree.size=auto, the predicted speedup) calls on a drafter
# ------------------------

@runtime_checkable
class CostProbe(Protocol):
    """A drafter that says what one round's drafting costs: every drafter of this project (eval.planner.cost.draft_curve
    calls nothing else, so no family is planned as free unless its own module says so)."""

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> list[float] | None:
        """ms of one round's drafting with s = n - 1 drafts for each n in `sizes`, the least of `reps` interleaved
        rounds (eval.engine.timing.interleaved), after the prefix `prefix_ids` (1, P) in steady state: the previous
        round accepted nothing, so one new position comes in. The verifier's features come through `engine`'s path
        (eval.engine.timing.prefix_cache). Leaves the drafter as a fresh one of its kind would be after that prefix.
        None: drafting is not timed, and the plan counts it as free; a drafter returning None says why in its
        docstring."""
        ...


class FixedTreeDrafter(Protocol):
    """A drafter whose family drafts one tree every round (its registry entry's `tree` is "fixed": Medusa,
    P-EAGLE, DFlash); eval.planner.shapes.predict scores that tree under the export's acceptance table."""

    tree: Tree  # the tree every round fills
    depth_limit: int  # the deepest tree it can fill (Medusa: its heads; P-EAGLE, DFlash: the slots of one forward)

    def set_tree(self, tree: Tree) -> None:
        """Draft `tree` from the next round on: how plan=adaptive (eval.planner.adaptive) re-plans between rounds."""
        ...


class BudgetDrafter(Protocol):
    """A drafter whose family grows its tree each round within a node budget (registry `tree` "dynamic": EAGLE);
    eval.planner.shapes.predict scores the best tree of that budget under the export's acceptance table, and
    plan=adaptive sets both fields between rounds."""

    size: int  # the drafts a round may grow (its node budget, root excluded)
    depth: int  # the deepest a round's tree may grow


@dataclass
class Prediction:
    """What a planner predicted for one decode's rounds, each before it ran: the rounds, E[tokens] and ms summed,
    and the plain step's ms (eval.planner.adaptive; the report puts the predicted speedup beside the measured one)."""

    rounds: int = 0
    tokens: float = 0.0
    ms: float = 0.0
    step_ms: float = 0.0

    @property
    def speedup(self) -> float:
        """Predicted tokens/s over plain decoding's one token per step."""
        return self.tokens * self.step_ms / self.ms if self.ms > 0 else 0.0


@runtime_checkable
class Planned(Protocol):
    """A drafter whose rounds a planner prices (eval.planner.adaptive.PlannedDrafter under tree.size=auto): what a
    drafter built around it (the hybrid) reads to choose, round by round, what else to verify with its drafts."""

    planned_nodes: int  # the nodes the round just proposed drafts, root included
    step_ms: float  # the plain step's predicted ms (the speedup's unit)
    can_skip: bool  # whether the drafter it plans can sit a round out (Skippable)

    def node_values(self) -> list[float]:
        """The round just proposed: each draft's predicted path-acceptance probability, best first."""
        ...

    def round_ms(self, nodes: int) -> float:
        """Predicted ms of the round just proposed if the verifier checks `nodes` nodes (root included): the
        verifier's forward over them and this drafter's drafting."""
        ...

    def verified_nodes(self, nodes: Sequence[int]) -> None:
        """Told before `accepted`: which nodes of its tree were verified (the others were left out for others')."""
        ...

    def prediction(self) -> Prediction:
        """What was predicted for the decode just finished; starts the next count."""
        ...


@runtime_checkable
class Skippable(Protocol):
    """A drafter that can sit a round out (a hybrid whose round is lookup's alone skips its drafter's forward) and
    catch up on the next: `skipped` is told, in place of `propose` and `accepted`, how many positions the round
    committed; the next `propose` is handed the features of all of them."""

    def skipped(self, positions: int) -> None:
        ...


@runtime_checkable
class Combination(Protocol):
    """A drafter built on another one with a second drafter's proposals grafted in (the hybrid): the harness decodes
    that grafted drafter by itself beside it too (report.json `grafted_alone`, as `drafter_alone` is the first one
    by itself), so a report shows the combination beside both of its parts."""

    def grafted_alone(self) -> Drafter:
        """A fresh drafter that drafts as the grafted part does, to decode by itself."""
        ...


# -- what the decode loop, the runner and the planner ask of a drafter that offers more (each optional: checked with
# isinstance against the protocol here, never by probing an attribute's name) ----------------------------------------

@runtime_checkable
class Observing(Protocol):
    """A drafter that learns from what the verifier computed at its nodes (lookahead): the decode loop hands it the
    round's tokens and the verifier's logits there, after each verify."""

    def observe(self, tokens: Tensor, q_logits: Tensor) -> None:
        """tokens: (B, N) the round's draft; q_logits: (B, N, V) M_q's logits at those nodes."""
        ...


@runtime_checkable
class Branching(Protocol):
    """A drafter that says whether its rounds may branch although its node count would fit a chain (the hybrid:
    lookup chains grafted beside the drafter's); block verification (eval.engine.acceptance.block) takes chains only."""

    branches: bool


@runtime_checkable
class Paced(Protocol):
    """A drafter whose rounds a planner predicts (a planned drafter, or a hybrid over one): the runner hands it the
    plain step measured on the coming prompt, and asks it, once the prompt is decoded, what it predicted."""

    def plain_step(self, ms: float) -> None:
        """The plain step's ms measured on the coming prompt: the prediction's pace."""
        ...

    def prediction(self) -> Prediction | None:
        """What was predicted for the decode just finished (None: nothing); starts the next count."""
        ...


@runtime_checkable
class CategoryPriced(Protocol):
    """A drafter that prices its rounds by the prompt's category (the hybrid's lookup chains): the runner tells it
    the category of the prompt it decodes next."""

    def prompt_category(self, category: str) -> None:
        ...


@runtime_checkable
class BuiltOn(Protocol):
    """A drafter built around another one (the hybrid around its `primary`): the planner plans that one in place."""

    primary: Drafter

    def set_primary(self, primary: Drafter) -> None:
        """Draft with `primary` (the same drafter under a planner) from now on."""
        ...


@runtime_checkable
class Assistant(Protocol):
    """A drafter that Hugging Face assisted generation can run as well (a draft model): the harness adds HF's
    `generate(assistant_model=...)` as a reference beside it (eval.runner.assistant_of)."""

    def hf_assistant(self) -> tuple[nn.Module, int]:
        """The model to pass as `assistant_model` and the drafts per round it proposes (`num_assistant_tokens`)."""
        ...

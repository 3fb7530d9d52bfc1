"""The acceptance rule of a speculative round, one seam for all of them: greedy, rejection sampling, Medusa's typical
acceptance and block verification, each a class with one `accept` and its own name and exactness, chosen once per run
from the sampling settings (`rule_for`), then called by the decode loop (eval.engine.decode) and named by the report.

A rule takes what one verifier forward gave for a proposed tree (the verifier's logits at every node) and the draft,
and returns the accepted root-to-leaf prefix and the verifier's next token (eval.engine.accept.Acceptance). Sampled
rules are listed under the `verify=` value that picks them; adding one is its module and one `register` call
(tests/toy_rule.py shows it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from eval.engine.accept import Acceptance, greedy_accept
from runtime.errors import UserError

if TYPE_CHECKING:
    from eval.engine.protocol import Draft

# The sampling settings (eval.engine.sampling.SamplingConfig, which imports this module to check `verify=`): read
# for `greedy`, `typical` and `verify` here, handed whole to the rule a `verify=` value names.
SamplingConfig = Any


@runtime_checkable
class AcceptanceRule(Protocol):
    """name: report.json's `sampling.rule`; exact: the output follows the (warped) verifier distribution (greedy:
    equals plain greedy decoding token for token); chains_only: defined on chains, a drafter proposing trees is
    refused before decoding."""

    name: str
    exact: bool
    chains_only: bool

    def accept(self, retrieve: Tensor, draft: Draft, logits: Tensor,
               generator: torch.Generator | None) -> Acceptance:
        """retrieve: (L, D+1) the tree's root-to-leaf node rows (eval.engine.tree.tree_buffers); logits: (B, N, V)
        the verifier's at every node; draft: the proposed tokens, tree and (sampled drafts) their probabilities."""
        ...


@dataclass(frozen=True)
class Greedy:
    """The longest path matching the verifier's argmax (eval.engine.accept.greedy_accept): the output is plain greedy
    decoding's, token for token."""

    name: str = "greedy"
    exact: bool = True
    chains_only: bool = False

    def accept(self, retrieve: Tensor, draft: Draft, logits: Tensor,
               generator: torch.Generator | None) -> Acceptance:
        return greedy_accept(retrieve, draft.tokens, logits)


# verify=<name> -> the sampled rule built from the run's sampling settings: the built-in ones by dotted path (each
# class lives beside its arithmetic, which imports this module), resolved when first asked for; others registered
SAMPLED_RULES: dict[str, Callable[[SamplingConfig], AcceptanceRule] | str] = {
    "token": "eval.engine.sampling.RejectionSampling",
    "block": "eval.engine.block_verify.BlockVerification",
    "typical": "eval.engine.sampling.TypicalAcceptance",
}
TYPICAL = "typical"  # typical=true picks it (Medusa's flag), whatever verify= says


def register(verify: str, build: Callable[[SamplingConfig], AcceptanceRule]) -> None:
    """Make `verify=<verify>` pick the rule `build(sampling)` returns for sampled decoding."""
    SAMPLED_RULES[verify] = build


def verify_names() -> tuple[str, ...]:
    """The `verify=` values a run may give (the sampled rules registered)."""
    return tuple(n for n in SAMPLED_RULES if n != TYPICAL)


def rule_for(sampling: SamplingConfig | None) -> AcceptanceRule:
    """The run's rule, chosen once: greedy at temperature 0 (or no sampling), typical acceptance with typical=true,
    else the sampled rule `verify=` names (token: rejection sampling; block: block verification)."""
    if sampling is None or sampling.greedy:
        return Greedy()
    return named_rule(sampling)


def named_rule(sampling: SamplingConfig) -> AcceptanceRule:
    """The rule the settings name (typical=, verify=), whatever the temperature: what a run holds its drafters to
    before decoding (verify=block with a tree is refused at temperature 0 too: block verification was asked for)."""
    name = TYPICAL if sampling.typical else sampling.verify
    if name not in SAMPLED_RULES:
        raise UserError(f"verify={name!r} is not one of {', '.join(verify_names())}: token verifies draft by draft "
                        f"(the default), block verifies a drafted chain jointly (tree=chain).")
    build = SAMPLED_RULES[name]
    if isinstance(build, str):  # a built-in rule, named by its dotted path
        module, _, cls = build.rpartition(".")
        build = SAMPLED_RULES[name] = getattr(importlib.import_module(module), cls)
    return build(sampling)

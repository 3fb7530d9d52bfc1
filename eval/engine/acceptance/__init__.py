"""The acceptance rule of a speculative round, one seam for all of them: greedy, rejection sampling, Medusa's typical
acceptance and block verification, each a class with one `accept` and its own name and exactness, chosen once per run
from the sampling settings (`rule_for`), then called by the decode loop (eval.engine.decode) and named by the report.

A rule takes what one verifier forward gave for a proposed tree (the verifier's logits at every node) and the draft,
and returns the accepted root-to-leaf prefix and the verifier's next token
(eval.engine.acceptance.protocol.Acceptance). Sampled rules are listed under the `verify=` value that picks them;
adding one is its module and one `register` call (tests/toy_rule.py shows it).

The package: protocol.py (the outcome, the rule's protocol, the sampled rules' shared step, tau and alpha_k),
greedy.py, sampled.py (rejection sampling over chains and trees; Medusa's typical acceptance), block.py (block
verification of a chain); here, the rule a run's settings pick.
"""

from __future__ import annotations

from collections.abc import Callable

from eval.engine.acceptance.block import BlockVerification
from eval.engine.acceptance.greedy import Greedy
from eval.engine.acceptance.protocol import AcceptanceRule
from eval.engine.acceptance.sampled import RejectionSampling, TypicalAcceptance
from eval.engine.sampling import SamplingConfig
from runtime.errors import UserError

# verify=<name> -> the sampled rule built from the run's sampling settings (the built-in ones, and any registered)
SAMPLED_RULES: dict[str, Callable[[SamplingConfig], AcceptanceRule]] = {
    "token": RejectionSampling,
    "block": BlockVerification,
    "typical": TypicalAcceptance,
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
    return SAMPLED_RULES[name](sampling)

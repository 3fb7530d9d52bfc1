"""Prompts of several lengths for the load sweep (sweep.py), as SPEED-Bench's throughput split reports short chat
turns apart from long inputs: named groups with token bounds, counted after the verifier's chat template.

    engine_prompt_lengths=[short,long]      # python -m eval; scripts.bench.serving_load: --lengths short long:8

- `short`: up to 511 tokens (the built-in eval split's chat categories run 36-130);
- `long`: 512 tokens and more (its `long_context` category: 905-1,522).

Each group's prompts are drawn from every eval prompt of the run's prompt set(s) that falls in its bounds, then
`num_prompts` of them (`name:N` for N) round-robin over their categories, as `num_prompts` draws the run's prompts:
on the built-in split `short` draws from the ten chat categories and `long` from long_context. The sweep runs once
per group on the same servers; report.json `engine_peers.vllm.by_length.<group>` holds each group's own rows.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.errors import UserError

GROUPS: dict[str, tuple[int, int | None]] = {"short": (1, 511), "long": (512, None)}  # tokens, inclusive


@dataclass(frozen=True)
class LengthGroup:
    """One group as asked for: its name, token bounds (high None: no bound) and prompt count (None: num_prompts)."""

    name: str
    low: int
    high: int | None
    count: int | None = None

    def holds(self, n: int) -> bool:
        return n >= self.low and (self.high is None or n <= self.high)

    @property
    def bounds(self) -> str:
        return f"{self.low}+ tokens" if self.high is None else f"{self.low}-{self.high} tokens"


@dataclass(frozen=True)
class PromptGroup:
    """A group's prompts as the sweep sends them: token ids, and the conversation ids they came from."""

    group: LengthGroup
    prompts: tuple[tuple[int, ...], ...]
    ids: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        """report.json's description of the group: bounds, prompts, prompt tokens (median, min, max)."""
        lengths = [len(p) for p in self.prompts]
        return {"bounds": [self.group.low, self.group.high], "prompts": len(lengths), "prompt_ids": list(self.ids),
                "prompt_tokens": {"median": statistics.median(lengths), "min": min(lengths), "max": max(lengths)}}


def parse_lengths(value: Any) -> tuple[LengthGroup, ...]:
    """`engine_prompt_lengths` (a name or a list of `name` / `name:N`) as groups, refused where a name is unknown,
    a count is not a whole number >= 1, or a group is named twice. None or []: no groups."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    out: list[LengthGroup] = []
    for item in items:
        name, _, count = str(item).partition(":")
        if name not in GROUPS:
            raise UserError(f"engine_prompt_lengths={items}: unknown group {name!r}; the groups are "
                            f"{', '.join(f'{g} ({LengthGroup(g, *GROUPS[g]).bounds})' for g in GROUPS)}, e.g. "
                            f"engine_prompt_lengths=[short,long], or long:8 for 8 long prompts.")
        if count and not (count.isdigit() and int(count) >= 1):
            raise UserError(f"engine_prompt_lengths={items}: {str(item)!r} asks for {count!r} prompts; give a whole "
                            f"number >= 1 after the colon (long:8), or the name alone for num_prompts of them.")
        if any(g.name == name for g in out):
            raise UserError(f"engine_prompt_lengths={items}: {name!r} is named twice; name each group once.")
        out.append(LengthGroup(name, *GROUPS[name], int(count) if count else None))
    return tuple(out)


def group_prompts(groups: Sequence[LengthGroup], pool: Sequence[tuple[str, str, list[int]]], num: int | None,
                  source: str) -> tuple[PromptGroup, ...]:
    """Each group's prompts from `pool` ((conversation id, category, token ids) of every eval prompt of the run's
    set(s)): those within its bounds, then its count (else `num`) round-robin over their categories. A group no
    prompt falls into is refused, naming the lengths the set has."""
    from data.prompts import Conversation, select_prompts

    out = []
    for g in groups:
        inside = [(cid, cat, ids) for cid, cat, ids in pool if g.holds(len(ids))]
        if not inside:
            lengths = sorted(len(ids) for _, _, ids in pool)
            raise UserError(f"engine_prompt_lengths: no prompt of prompts={source} falls in {g.name!r} "
                            f"({g.bounds} after the verifier's chat template); its {len(lengths)} eval prompts run "
                            f"{lengths[0]}-{lengths[-1]} tokens. Leave {g.name!r} out, or add a prompt set that has "
                            f"such prompts (prompts=builtin: its long_context category runs 900+ tokens).")
        by_id = {cid: ids for cid, _, ids in inside}
        chosen = select_prompts([Conversation(cid, cat, []) for cid, cat, _ in inside], g.count or num)
        out.append(PromptGroup(g, tuple(tuple(by_id[c.id]) for c in chosen), tuple(c.id for c in chosen)))
    return tuple(out)


def rendered_pool(pool: Sequence[Sequence[Any]], tokenizer: Any, rendering: str) -> list[tuple[str, str, list[int]]]:
    """Every eval prompt of the run's prompt set(s) (`pool`, set by set: data.prompts.load_prompt_pool), its first
    user turn as the verifier sees it."""
    from data.chat import prompt_ids
    from eval.runner import user_turns

    return [(c.id, c.category, prompt_ids(tokenizer, user_turns(c)[0], rendering)) for convs in pool for c in convs]

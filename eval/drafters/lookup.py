"""Prompt lookup (Saxena, 2023; Hugging Face's `prompt_lookup_num_tokens`, vLLM's `ngram` speculator): no draft
model. The last n tokens so far are searched for earlier in the prompt and the generated text; the tokens that
followed the match are the draft chain. Strong where the answer copies its input (translation of names, code edits,
summaries quoting the source), nothing elsewhere: a round without a match drafts no token and costs one plain step.

Matching as Hugging Face's `PromptLookupCandidateGenerator`: try n = max_ngram_size down to min_ngram_size; for the
first n with a match, take the earliest match whose continuation is not empty and propose up to `num_tokens` of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from eval.engine.protocol import Draft
from eval.engine.tree import Chain, TreePolicy, chain
from runtime.errors import UserError

if TYPE_CHECKING:
    from models.verifiers.core import Verifier


def match(tokens: Tensor | Sequence[int], num_tokens: int, max_ngram_size: int = 3,
          min_ngram_size: int = 1) -> tuple[list[int], int]:
    """(the continuation of the earliest earlier occurrence of the longest matching suffix n-gram of `tokens`, at most
    `num_tokens` long; that n), n from max_ngram_size down to min_ngram_size; ([], 0) when nothing matches. One
    vectorised comparison per n-gram position over the whole sequence (a long prompt costs microseconds, not a Python
    loop over its positions)."""
    arr = tokens.detach().cpu().numpy() if isinstance(tokens, Tensor) else np.asarray(tokens)
    length = len(arr)
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        starts = length - n  # earlier occurrences only: the suffix itself starts at length - n
        hit = arr[:starts] == arr[starts]
        for i in range(1, n):
            hit &= arr[i : starts + i] == arr[starts + i]
        found = np.flatnonzero(hit)
        if found.size:  # its continuation is never empty: it starts before the suffix does
            first = int(found[0]) + n
            return arr[first : first + num_tokens].tolist(), n
    return [], 0


def lookup(tokens: Tensor | Sequence[int], num_tokens: int, max_ngram_size: int = 3,
           min_ngram_size: int = 1) -> list[int]:
    """The continuation of the earliest earlier occurrence of the longest matching suffix n-gram of `tokens`
    (n from max_ngram_size down to min_ngram_size), at most `num_tokens` long; [] when nothing matches."""
    return match(tokens, num_tokens, max_ngram_size, min_ngram_size)[0]


class PromptLookupDrafter:
    """`drafter=prompt_lookup`: a chain of up to `num_tokens` drafts copied from the text so far (tree=chain; depth
    null: num_tokens). Stateless: every round searches the whole sequence."""

    feature_layers = (-1,)  # handed by the loop, never read
    reads_hidden = False

    def __init__(self, tree: TreePolicy = Chain(), num_tokens: int = 10, max_ngram_size: int = 3,
                 min_ngram_size: int = 1) -> None:
        if not isinstance(tree, Chain):
            raise UserError(f"tree={type(tree).__name__} does not fit prompt lookup, which drafts one chain; use "
                            f"tree=chain (tree.depth=<N> caps the drafts, null: drafter.num_tokens).")
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise UserError(f"prompt lookup needs 1 <= min_ngram_size <= max_ngram_size; got min_ngram_size="
                            f"{min_ngram_size}, max_ngram_size={max_ngram_size}.")
        depth = num_tokens if tree.depth is None else tree.depth
        if depth < 1:
            raise UserError(f"prompt lookup with {depth} draft tokens drafts nothing; set drafter.num_tokens >= 1.")
        self.num_tokens, self.max_ngram, self.min_ngram = depth, max_ngram_size, min_ngram_size
        self.max_nodes, self.max_depth = depth + 1, depth

    def describe(self) -> dict[str, Any]:
        return {"policy": "chain", "depth": self.num_tokens, "max_nodes": self.max_nodes,
                "max_ngram_size": self.max_ngram, "min_ngram_size": self.min_ngram}

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        if input_ids.shape[0] != 1:
            raise UserError(f"Prompt lookup runs one sequence at a time; got batch size {input_ids.shape[0]}.")
        found = lookup(input_ids[0], self.num_tokens, self.max_ngram, self.min_ngram)
        drafts = torch.tensor([found], dtype=input_ids.dtype, device=input_ids.device).view(1, len(found))
        return Draft(tree=chain(len(found)), tokens=torch.cat([input_ids[:, -1:], drafts], dim=1))  # (1, 1+n)

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        pass  # stateless

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> None:
        """eval.engine.protocol.CostProbe: not timed, planned as free. A string search over the tokens so far, no model
        forward; its chain is its own (drafter.num_tokens), which tree.size=auto does not plan."""


LOOKUP_TOKENS = 10  # prompt lookup's chain length (conf/drafter/prompt_lookup.yaml), and the hybrid's by default




# conf/drafter/prompt_lookup.yaml's factory (eval.drafters.build.build_drafter calls it)
def prompt_lookup(verifier: Verifier, tree: TreePolicy, checkpoint: Any = None, num_tokens: int = LOOKUP_TOKENS,
                  max_ngram_size: int = 3, min_ngram_size: int = 1) -> PromptLookupDrafter:
    return PromptLookupDrafter(Chain(num_tokens), num_tokens, max_ngram_size, min_ngram_size)

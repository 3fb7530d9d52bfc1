"""Lookahead decoding (Fu et al., 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"): no draft model. Jacobi iterations on a window of W guessed future tokens run inside the verifier's own
forward; the trajectories they leave form an n-gram pool; pool n-grams that start with the current token are verified
as drafts in the same forward.

What one round does here (a drafter in eval.drafters.build' protocol, with the optional `observe` hook
eval.engine.decode calls with the verifier's logits at every node it just verified):
1. Verification branch: up to G pool n-grams keyed by the root (the token M_q chose last), each N-1 drafts, merged
   into a trie under the root.
2. Lookahead branch: the window's W guesses for the positions after the root, as one more chain under the root.
3. After the forward, `observe` reads M_q's argmax at the root and at every window node: one Jacobi step, the new
   guesses for the positions after them (this level). From the last N levels, every diagonal (level -N at position p,
   level -N+1 at p+1, ..., the newest at p+N-1; each token predicted after the one before it) is an n-gram for the
   pool, keyed by its first token, at most G per key, the newest kept.
4. The next window is the newest level at the positions still ahead of the new root, padded with tokens drawn from
   the prompt (the paper initialises the window randomly as well).

What differs from the paper, exactly:
- The paper feeds the lookahead branch as a 2D window of (N-1) x W tokens (the last N-1 levels) under a special
  attention layout, so each new token is conditioned on its diagonal trajectory. The protocol here verifies a tree
  (each node sees its ancestors only), so the window is fed as one causal chain of the newest level alone: each
  position is conditioned on the current guesses before it (plain Jacobi decoding, Santilli et al., 2023). The older
  levels live on the drafter side only, to form the n-grams. The window costs W tree nodes instead of (N-1) x W.
- The window chain is also a draft: when its first guesses are right they are accepted like any candidate.
- `pool_from_prompt` (off by default) seeds the pool with the prompt's own n-grams, as the authors' code can.
Greedy only, as the rest of this loop; the output is plain greedy's token for token whatever the pool holds.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from eval.engine.protocol import Draft
from eval.engine.tree import Tree, TreePolicy
from runtime.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from models.verifiers.core import Verifier


class LookaheadDrafter:
    """`drafter=lookahead`: window W, n-gram size N, at most G verified n-grams a round."""

    feature_layers = (-1,)  # handed by the loop, never read
    reads_hidden = False

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, pool_from_prompt: bool = False,
                 seed: int = 0) -> None:
        if window < 1 or ngram < 2 or guesses < 0:
            raise UserError(f"lookahead needs window >= 1, ngram >= 2 and guesses >= 0; got window={window}, "
                            f"ngram={ngram}, guesses={guesses}.")
        self.window, self.ngram, self.guesses, self.from_prompt = window, ngram, guesses, pool_from_prompt
        self.max_nodes = 1 + guesses * (ngram - 1) + window
        self.max_depth = max(ngram - 1, window)
        self.seed = seed
        self._reset([])

    def describe(self) -> dict[str, Any]:
        return {"policy": "lookahead", "window": self.window, "ngram": self.ngram, "guesses": self.guesses,
                "pool_from_prompt": self.from_prompt, "max_nodes": self.max_nodes, "max_depth": self.max_depth}

    def _reset(self, prompt: list[int]) -> None:
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.levels: deque[dict[int, int]] = deque(maxlen=self.ngram)  # position -> token, oldest first
        self.prompt = prompt
        self.gen = torch.Generator().manual_seed(self.seed)
        self._root_pos, self._window_nodes = -1, []
        if self.from_prompt:
            n = self.ngram
            for p in range(len(prompt) - n + 1):
                self._add(tuple(prompt[p : p + n]))

    def _add(self, gram: tuple[int, ...]) -> None:
        grams = self.pool.setdefault(gram[0], [])
        if gram[1:] in grams:
            grams.remove(gram[1:])
        grams.append(gram[1:])  # newest last
        if len(grams) > self.guesses:
            grams.pop(0)

    def _random_tokens(self, n: int) -> list[int]:
        if n <= 0 or not self.prompt:
            return [0] * max(n, 0)
        idx = torch.randint(len(self.prompt), (n,), generator=self.gen)
        return [self.prompt[i] for i in idx.tolist()]

    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        if input_ids.shape[0] != 1:
            raise UserError(f"Lookahead decoding runs one sequence at a time; got batch size {input_ids.shape[0]}.")
        tokens = input_ids[0].tolist()
        if hidden.shape[1] == len(tokens) - 1:  # the prefill: the loop hands features for the whole prompt
            self._reset(tokens[:-1])
        root, root_pos = tokens[-1], len(tokens) - 1
        newest = self.levels[-1] if self.levels else {}
        ahead = [newest[p] for p in range(root_pos + 1, root_pos + 1 + self.window) if p in newest]
        window = ahead + self._random_tokens(self.window - len(ahead))
        # A trie of token paths under the root: the verification branch first, then the window chain.
        parents, node_tokens, child = [-1], [root], {}

        def insert(path: list[int] | tuple[int, ...]) -> list[int]:
            node, nodes = 0, []
            for t in path:
                if (node, t) not in child:
                    child[(node, t)] = len(parents)
                    parents.append(node)
                    node_tokens.append(t)
                node = child[(node, t)]
                nodes.append(node)
            return nodes

        for gram in reversed(self.pool.get(root, [])):  # newest first
            insert(gram)
        self._window_nodes = insert(window)
        self._window, self._root_pos = window, root_pos
        ranks, seen = [-1], {}
        for parent in parents[1:]:
            seen[parent] = seen.get(parent, -1) + 1
            ranks.append(seen[parent])
        draft = torch.tensor([node_tokens], dtype=input_ids.dtype, device=input_ids.device)  # (1, N)
        return Draft(tree=Tree(parents=tuple(parents), ranks=tuple(ranks)), tokens=draft)

    @torch.no_grad()
    def observe(self, tokens: Tensor, q_logits: Tensor) -> None:
        """One Jacobi step from the verifier's argmax at the root and the window nodes; new n-grams to the pool.

        tokens: (1, N) the draft just verified (as proposed); q_logits: (1, N, V) the verifier's logits there."""
        argmax = q_logits[0].argmax(dim=-1)  # (N,)
        outs = argmax[[0, *self._window_nodes]].tolist()  # predictions for positions root_pos+1 .. root_pos+W+1
        level = {self._root_pos + 1 + i: t for i, t in enumerate(outs)}
        self.levels.append(level)
        if len(self.levels) == self.ngram:
            first = self.levels[0]
            for p in sorted(first):
                gram = [first[p]]
                for k in range(1, self.ngram):
                    t = self.levels[k].get(p + k)
                    if t is None:
                        break
                    gram.append(t)
                if len(gram) == self.ngram:
                    self._add(tuple(gram))

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        pass  # the next propose finds its window from the positions alone

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> None:
        """eval.engine.protocol.CostProbe: not timed, planned as free. Its guesses come from the verifier's own forward
        (`observe`) and a pool look-up, no drafter forward; its window and n-grams are its own options, which
        tree.size=auto does not plan."""


# conf/drafter/lookahead.yaml's factory (eval.drafters.build.build_drafter calls it)
def lookahead(verifier: Verifier, tree: TreePolicy, checkpoint: Any = None, window: int = 5, ngram: int = 4,
              guesses: int = 5, pool_from_prompt: bool = False) -> LookaheadDrafter:
    return LookaheadDrafter(window, ngram, guesses, pool_from_prompt)

"""What every drafter that reads the verifier's hidden states shares at decode time (EAGLE-1 and EAGLE-3,
eval/drafters/eagle.py; the parallel drafters, eval/drafters/parallel.py: P-EAGLE, DFlash and the block drafters
built on it): the network and the drafting head (the verifier's, cut to `head_ids` where asked, or the drafter's own
over a draft vocabulary), the cache of the committed positions and its sync check (`_new_positions`, `accepted`,
`skipped`), draft ids as verifier ids, and the planner's cost probe (`draft_cost` over the family's `trial`).

`_extend` adds the positions the verifier just committed to the cache. By default it is the unrolled drafters'
(EAGLE's and P-EAGLE's): step-0 keys of each new position, whose output at the last one gives depth 1; DFlash's line
keeps a per-layer context cache instead (eval/drafters/dflash.py overrides it and `cache_length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from eval.drafters.heads import row_head
from eval.engine.forward import packed_head
from eval.engine.protocol import Draft
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import Tree
from models.eagle import VerifierFedNet
from models.eagle_decode import DecodeStep, DraftKV
from models.verifiers.core import Verifier
from runtime.errors import UserError


class VerifierFedDrafter:
    """The shared part of a verifier-fed drafter (eval.engine.protocol.Drafter; module docstring). A family adds its
    rounds: `propose` and the planner's `trial`.

    sampling: with a SamplingConfig of temperature > 0, drafts are sampled from the drafter's warped distribution,
        and `Draft.p` carries it over the verifier's vocabulary; without it, top-k drafts.
    head_ids: draft over these rows of the verifier's head only (a head shared with the verifier)."""

    net: Any

    def __init__(self, net: VerifierFedNet, verifier: Verifier, sampling: SamplingConfig | None = None,
                 generator: torch.Generator | None = None, head_ids: Tensor | None = None) -> None:
        self.net = net.eval().requires_grad_(False)
        self.embed, self.lm_head = verifier.token_embedding, packed_head(verifier.lm_head)
        # Drafting over a subset of the vocabulary (`head_ids`, verifier ids) of a head shared with the verifier: the
        # head is those rows of its lm_head, so a depth reads |head_ids| x D weights instead of V x D (FR-Spec, Zhao
        # et al. 2025). Draft ids index head_ids. Exactness is the verifier's: only which tokens get drafted changes.
        self.head_ids: Tensor | None = None
        if head_ids is not None:
            if not net.shares_verifier_head:
                raise UserError("draft_vocab restricts a drafting head that is the verifier's lm_head (EAGLE-1, "
                                "DFlash); EAGLE-3 drafts over its own trained draft vocabulary. Leave "
                                "drafter.draft_vocab=null.")
            self.head_ids = head_ids.sort().values.to(verifier.device)
            self.lm_head = row_head(verifier, self.head_ids)
        self.head_size = net.draft_vocab_size if self.head_ids is None else self.head_ids.numel()
        self.feature_layers = net.feature_layers
        # (B, H_kv, P, hd) step-0 keys of the committed positions 0..P-1: a prefix view of `_kv`'s buffers, whose
        # later slots hold the keys of one propose's drafted nodes (never committed: eval/drafters/eagle.py)
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self._kv = DraftKV()
        self._step: DecodeStep | None = None  # the layer with its weights fused, made at the first forward
        self._next: int | None = None  # positions the next round must bring (1 + accepted), for a sync check
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.generator, self.vocab_size = generator, int(verifier.vocab_size)

    @property
    def cache_length(self) -> int:
        """Committed positions whose step-0 keys are cached (= tokens so far minus the root)."""
        return 0 if self._k is None else self._k.shape[2]


    # -- 1. the committed prefix -----------------------------------------------------------------------------------
    def _new_positions(self, input_ids: Tensor, hidden: Tensor) -> tuple[int, int, dict[int, Tensor]]:
        """The committed positions start..n-1 this round brings (n = tokens so far minus the root), checked against
        the cache (a new sequence, the prefill, forgets the last one), and their verifier features by layer id."""
        s = hidden.shape[1]
        n = input_ids.shape[1] - 1  # positions with known features once this round's are in
        start = n - s
        if start == 0:
            self._k = self._v = self._next = None
        elif start != self.cache_length or (self._next is not None and s != self._next):
            raise UserError(f"{type(self).__name__} out of step: it caches {self.cache_length} positions but was "
                            f"handed {s} new features ending at position {n - 1}. Call propose/accepted as "
                            f"eval.engine.decode.speculative_decode does, one sequence at a time.")
        names = self.feature_layers
        return start, n, dict(zip(names, hidden.split(hidden.shape[-1] // len(names), dim=-1)))

    @property
    def fast(self) -> DecodeStep:
        """The drafter's layer for decode time (models.eagle_decode: net.step's bits, fewer eager ops)."""
        if self._step is None:
            self._step = DecodeStep(self.net)
        return self._step

    def _forward(self, hidden: Tensor, embeds: Tensor, positions: Tensor, mask: Tensor, at: int) -> Tensor:
        """One drafter forward whose keys go to slots at.. of `_kv`, attending slots 0..at+T-1 (`DecodeStep`); through
        `net.step` itself where the instance's step was replaced (a wrapper or a test's probe), the same bits."""
        if "step" not in vars(self.net):
            return self.fast(hidden, embeds, positions, mask, self._kv, at)
        kv, bsz, t = self._kv, hidden.shape[0], hidden.shape[1]
        past = (kv.k[:, :, :at], kv.v[:, :, :at]) if at else (None, None)
        out, k, v = self.net.step(hidden, embeds, positions[None].expand(bsz, t), mask, *past)
        kv.reserve(k, at + t, at)
        with torch.inference_mode():
            kv.k[:, :, at : at + t], kv.v[:, :, at : at + t] = k, v
        return out


    def _extend(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        """Add step-0 keys for the S newly committed positions; return the output at the last one. (B, D)"""
        bsz, s = hidden.shape[:2]
        start, n, layers = self._new_positions(input_ids, hidden)
        feats = self.net.features(layers)  # (B, S, D): F_t, t = start..n-1
        emb = self.embed(input_ids[:, start + 1 : n + 1])  # (B, S, D): x_{t+1}, the last is the root
        pos = torch.arange(start, n, device=input_ids.device)
        mask = (torch.arange(n, device=pos.device)[None, :] <= pos[:, None])[None, None].expand(bsz, 1, s, n)
        self._kv.adopt(self._k, self._v)  # slots 0..start-1 (a view of the buffers unless a caller set them)
        out = self._forward(feats, emb, pos, mask, start)
        self._k, self._v = self._kv.k[:, :, :n], self._kv.v[:, :, :n]  # (B, H_kv, n, hd)
        return out[:, -1]


    def to_verifier(self, draft_ids: Tensor) -> Tensor:
        """Verifier ids of draft ids (indices into the drafting head's rows)."""
        return self.net.draft_to_target(draft_ids) if self.head_ids is None else self.head_ids[draft_ids]

    # -- 2. a round: the family's ------------------------------------------------------------------------------------
    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        """Extend the cache with M_q's newly committed features, then draft this round's tree."""
        raise NotImplementedError

    def trial(self, input_ids: Tensor, hidden: Tensor, drafts: int) -> Tree | None:
        """One round's drafting as a drafter planned for `drafts` drafts does it, leaving the cache as it was (what
        eval.planner.cost.draft_curve times, through `draft_cost`)."""
        raise NotImplementedError

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> list[float]:
        """eval.engine.protocol.CostProbe: the prefix's features fed as a prefill, a round that accepted nothing, then
        `trial` (the round a plan of s drafts pays for: EAGLE's layer over the new features and s nodes grown;
        P-EAGLE's and DFlash's one forward over the depth s drafts buy) for every size."""
        from eval.engine.timing import interleaved, prefix_cache

        cache, layers = prefix_cache(verifier, prefix_ids, engine), self.feature_layers
        self.propose(prefix_ids, cache.forward(prefix_ids[:, :-1], layers=layers).hidden)  # the prefill
        self.accepted(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
        new = cache.forward(prefix_ids[:, -1:], layers=layers).hidden  # (1, 1, D): the last prefix position
        seq = torch.cat([prefix_ids, prefix_ids[:, -1:]], dim=1)  # which root does not change the cost
        return [round(t, 3) for t in interleaved([lambda n=n: self.trial(seq, new, n - 1) for n in sizes], reps)]

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Roll back to the accepted prefix. The cache already holds committed positions only (drafted keys never
        enter it), so this records that the next round brings 1 + num_accepted new positions."""
        self._next = 1 + int(num_accepted[0])

    def skipped(self, positions: int) -> None:
        """eval.engine.protocol.Skippable: a round this drafter sat out committed `positions` more positions; the
        next `propose` brings their features too (a hybrid holds them), and extends the cache over all of them."""
        self._next = (self._next or 0) + positions


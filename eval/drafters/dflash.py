"""DFlash at decode time (models/dflash.py): one drafter forward drafts a block.

The drafter keeps every layer's context keys and values for the positions the verifier has committed (made from the
verifier's features at those positions; nothing drafted ever enters them, so an accepted prefix needs no rollback:
the next round brings its features). Each round it adds the newly committed positions, then runs one block, the
root and K mask tokens, attending the whole context and each other; slot k's output through the verifier's head is
the distribution of the depth-k draft. The tree is fixed, as for P-EAGLE and Medusa (eval/drafters/parallel.py fills
it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from eval.drafters.parallel import ParallelDrafter, family_tree
from eval.engine.protocol import Draft
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import TreePolicy
from models.dflash import DFlashNet
from models.verifiers.core import Verifier


class DFlashDrafter(ParallelDrafter):
    """DFlash for the drafter protocol: a per-layer context cache, one block forward per round, a fixed tree."""

    title = "DFlash"

    @property
    def cache_length(self) -> int:
        return 0 if self._k is None else self._k.shape[3]  # (L, B, H_kv, P, hd)

    def _extend(self, input_ids: Tensor, hidden: Tensor) -> None:
        """Add the context keys and values of the S newly committed positions (features `hidden`)."""
        bsz, s = hidden.shape[:2]
        start, n, layers = self._new_positions(input_ids, hidden)
        ctx = self.net.features(layers)
        pos = torch.arange(start, n, device=input_ids.device)[None].expand(bsz, s)
        k, v = self.net.context_kv(ctx, pos)
        self._k = k if self._k is None else torch.cat([self._k, k], dim=3)
        self._v = v if self._v is None else torch.cat([self._v, v], dim=3)
        self._root = input_ids[:, -1:]

    def _slots(self, depth: int) -> Tensor:
        """One block, [root, K masks] at positions n..n+K over the whole context (K = `depth`): the K slot outputs
        (K, D), slot k's for depth k."""
        root, n = self._root, self.cache_length
        tokens = torch.cat([root, torch.full((1, depth), self.net.mask_token_id, device=root.device)], dim=1)
        pos = (n + torch.arange(depth + 1, device=root.device))[None]
        mask = torch.ones(1, 1, depth + 1, n + depth + 1, dtype=torch.bool, device=root.device)
        return self.net.block(self.embed(tokens), pos, mask, self._k, self._v)[0, 1:]  # (K, D)

    def _depth_logits(self, root_out: Any, depth: int | None = None) -> Tensor:
        """One block forward (K: `depth`, the tree's max_depth by default): slot k's logits are depth k's, or, for a
        block whose depths condition on the parent's token (`_child_logits`), the top-1 chain's: each depth's given
        the token the depth before drafted (its argmax), as a chain round computes them. (K, V)"""
        out = self._slots(self.max_depth if depth is None else depth)
        base = self.net.logits(out, self.lm_head).float()  # (K, V)
        if not self.conditions_on_parent:
            return base
        prev, state, rows = self._root[0], None, []
        for d in range(out.shape[0]):
            logits, state = self._child_logits(out[d : d + 1], base[d], prev, state)
            rows.append(logits[0])
            prev = logits.argmax(-1)
        return torch.stack(rows)

    # -- a block whose depths condition on the parent's token (DSpark's Markov bias, DFlash2's selector) --------------
    conditions_on_parent = False  # True: a depth's logits depend on its parent's token (`_child_logits`)

    @torch.no_grad()
    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        """A block whose depths condition on the parent's token: 1. the new committed positions; 2. one block
        forward; 3. its depths (`_draft_block`). Otherwise every parallel drafter's round."""
        if not self.conditions_on_parent:
            return super().propose(input_ids, hidden)
        _, root = self._start_round(input_ids, hidden)
        tree = self.tree
        if tree.num_drafts == 0:
            return Draft(tree=tree, tokens=root)
        out = self._slots(tree.max_depth)
        tokens = torch.empty(tree.num_nodes, dtype=root.dtype, device=root.device)
        tokens[0] = root[0, 0]
        p = None if self.sampling is None else torch.zeros(tree.num_nodes, self.vocab_size, device=root.device)
        return self._draft_block(out, tokens, p)

    def _draft_block(self, out: Tensor, tokens: Tensor, p: Tensor | None) -> Draft:
        """The block step of a family whose depths condition on the parent's token: from the slot outputs `out`
        (K, D), fill the nodes' `tokens` (N,; the root's in place) depth by depth (`_draft_children`), and their
        sampled distributions `p` (N, V; None without sampling); return the round's Draft."""
        raise NotImplementedError

    def _child_logits(self, out: Tensor, base: Tensor, prev: Tensor, state: Any) -> tuple[Tensor, Any]:
        """The block step of a family whose depths condition on the parent's token: the logits (m, V) of the
        children of parents with tokens `prev` (m,) at one depth, from the slot's output `out` (1, D) and its base
        logits `base` (V,); `state` is what one depth passes the next along a path (DSpark's rnn head), None at
        depth 1. Returns the logits and the state passed on."""
        raise NotImplementedError

    def _depth_nodes(self, d: int, device: torch.device) -> tuple[list[int], list[int], Tensor]:
        """The tree's nodes at depth d, their parents (sorted), and each node's parent's row among them."""
        tree = self.tree
        kids = [i for i in range(1, tree.num_nodes) if tree.depths[i] == d]
        parents = sorted({tree.parents[i] for i in kids})
        at = {q: i for i, q in enumerate(parents)}
        return kids, parents, torch.tensor([at[tree.parents[i]] for i in kids], device=device)

    def _draft_children(self, logits: Tensor, kids: list[int], row: Tensor, tokens: Tensor, p: Tensor | None) -> None:
        """Fill the nodes `kids` from their parents' logits (m, Vd), `row` a node's parent's row: a sample of the
        warped distribution (kept in p) or the node's rank of the top-k."""
        if self.sampling is not None:
            assert p is not None
            probs = self._full_probs_of(logits)  # (m, V)
            draws = torch.multinomial(probs[row], 1, generator=self.generator)[:, 0]
            tokens[kids] = draws.to(tokens.dtype)
            p[kids] = probs[row]
        else:
            ranks = [self.tree.ranks[i] for i in kids]
            top = logits.topk(max(ranks) + 1, dim=-1).indices  # (m, R)
            rank = torch.tensor(ranks, device=logits.device)
            tokens[kids] = self.to_verifier(top[row, rank]).to(tokens.dtype)


def dflash_drafter(net: DFlashNet, config: dict[str, Any], verifier: Verifier, tree: TreePolicy,
                   sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                   head_ids: Tensor | None = None) -> DFlashDrafter:
    """The DFlash drafter for a loaded network (models/families.py names it the family's decoder): a fixed tree under
    `tree` (tree=auto from the export's eagle_topk_accuracy), at most K = block_size - 1 deep. `head_ids`: draft
    over those rows of the verifier's head only (`drafter.draft_vocab`, or the rows an export trained on with
    `model.train_vocab`)."""
    shape, name, table = family_tree("dflash", net.parallel, config, tree)
    return DFlashDrafter(net, verifier, shape, policy=name, sampling=sampling, generator=generator, head_ids=head_ids,
                         table=table)


def block_ranks(net: DFlashNet, verifier: Verifier, batch: dict[str, Tensor], depth: int,
                logits_of: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, ...]:
    """Teacher-forced scoring of a block drafter: every position's block as in validation (models.dflash.block_rows,
    every anchor, whole blocks), slot j's logits `logits_of(slot outputs, the token before its target)` ranked against
    M_q's argmax j+1 tokens on; (D, B, T) ranks, validity and the draft's top-1 probability, as
    eval.drafters.eagle.eagle_ranks."""
    from data.hidden_cache import gather_layers
    from eval.drafters.scoring import rank_rows
    from models.dflash import block_rows

    layers = list(dict.fromkeys([*net.feature_layers, -1]))
    states = gather_layers(batch, layers, verifier, layers)
    ids, n = batch["input_ids"], batch["input_ids"].shape[1] - 1
    q_arg = verifier.lm_head(states[-1]).argmax(-1)  # (B, T): M_q's greedy token after each position
    vocab = verifier.vocab_size
    ranks, valids, confs = [], [], []
    steps = block_rows(net, net.features(states)[:, :n], ids, batch["attention_mask"], batch["loss_mask"].bool(),
                       verifier.token_embedding, net.parallel, None)
    for j, step in zip(range(depth), steps):
        valid, bi, ti = step.valid, step.batch, step.position
        logits = logits_of(step.at_targets, ids[bi, ti + j + 1])  # (N, V)
        rank, conf = rank_rows(logits, q_arg[bi, ti + j + 1], valid, vocab, net.target_rank)
        ranks.append(torch.cat([rank, rank.new_full((rank.shape[0], 1), vocab)], dim=1))  # (B, n) -> (B, T)
        valids.append(torch.cat([valid, valid.new_zeros((valid.shape[0], 1))], dim=1))
        confs.append(torch.cat([conf, conf.new_zeros((conf.shape[0], 1))], dim=1))
    return torch.stack(ranks), torch.stack(valids), torch.stack(confs)


def dflash_ranks(net: DFlashNet, verifier: Verifier, batch: dict[str, Tensor], depth: int,
                 keep: Tensor | None = None) -> tuple[Tensor, ...]:
    """The registry's `teacher_forced` for DFlash and DSpark (eval.offline.score_export): `block_ranks` on the slot
    logits through the verifier's head (with `keep`, over those rows). A DSpark network is scored on its backbone's
    logits (the Markov bias needs the drafted prefix)."""
    from eval.drafters.scoring import keep_only

    return block_ranks(net, verifier, batch, depth,
                       lambda h, _: keep_only(net.logits(h, verifier.lm_head).float(), keep))

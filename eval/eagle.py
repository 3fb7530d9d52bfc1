"""EAGLE drafters at decode time (Li et al., 2024; EAGLE-2 dynamic trees, Li et al., 2024b; EAGLE-3, 2025).

Alignment, as in training (train/eagle.py): the drafter's step 0 at position t reads (token x_{t+1}, feature F_t)
and predicts x_{t+2}. When M_q has committed positions up to the token before the root, every feature F_t there
pairs with a known token x_{t+1} (the last with the root itself), so each round the drafter first extends its own
KV cache with step-0 keys for exactly the positions M_q just committed, then drafts: the step-0 output at the last
one gives the root's children; a drafted node at depth d reads (its token, its parent's output) at rotary position
(P - 1 + d) for a cache of P positions, and attends the cache, its drafted ancestors and itself -- what step d of the
training-time unroll sees. Drafted keys come from predicted features, never the verifier's, so they live only inside
one `propose`: the cache keeps committed step-0 keys alone, and the next round recomputes the accepted tokens' keys
from M_q's true features (the rollback EAGLE does).

Trees: a chain given as `tree` drafts the top-1 chain of that length; any other tree is a budget for an EAGLE-2
dynamic tree of the same depth and node count (`budget_tree` builds one): from the root, expand the `topk` children
of the `topk` best frontier nodes by cumulative log-probability, one batched drafter forward per depth, then keep
the `total_tokens` best of all drafted nodes (a child never beats its parent, so the kept set is a tree).

Defaults for this CPU (2 cores, torch on 1 thread, SmolLM2-135M fp32 verifier, 200-token prefix): depth 5, topk 16,
total_tokens 24. topk 16 rather than EAGLE-2's 10: drafters trained on a CPU budget get ~0.3 of their top-1 right, so
the best small tree is wide at depth 1 (the 16 best candidates hold M_q's token 65-71% of the time, the 8 best
59-60%), and topk caps that width. Measured with the cpu_full exports on 10 eval prompts, 16-node trees: EAGLE-1 tau
1.68 at topk 8, 1.84 at 16; EAGLE-3 1.78 at both, and 1.84 at both with 24 nodes; tokens/s equal within 2%.
Measured with eval.kv.forward, a verifier forward over 1 / 6 / 25 / 33 / 65 nodes costs 59 / ~105 / 163 / 185 /
290 ms: one token is bound by streaming the weights, and past a few nodes each one adds ~3 ms, about 5%
of a plain greedy step. A round drafting a depth-5 tree costs 33 ms with EAGLE-3 (8k draft vocabulary) and ~110 ms
with EAGLE-1 (its full 49k-vocabulary lm_head per depth dominates; topk 4 saves only ~10%), 21 / 63 ms for a
5-chain. So 24 nodes cost 2.8x a greedy step to verify and 32 would add ~10% more per round for tail nodes whose
cumulative probability is lowest; deeper than 5 pays a drafter forward per level for paths that rarely survive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eval.drafters import Draft
from eval.tree import Tree, chain
from models.eagle import NAMES, EagleDrafterNet, load_eagle_export
from models.errors import UserError
from models.verifier import Verifier

DEFAULT_DEPTH = 5
DEFAULT_TOPK = 16
DEFAULT_TOTAL_TOKENS = 24


def budget_tree(depth: int = DEFAULT_DEPTH, total_tokens: int = DEFAULT_TOTAL_TOKENS) -> Tree:
    """A placeholder tree that asks an EAGLE drafter for a dynamic tree of at most `depth` levels and
    `total_tokens` draft nodes: a spine of `depth` top-1 nodes plus side nodes (the loop sizes its checks on it)."""
    if not 1 <= depth <= total_tokens:
        raise UserError(f"a dynamic tree needs 1 <= depth <= total_tokens; got depth={depth}, "
                        f"total_tokens={total_tokens}.")
    parents, ranks = [-1] + list(range(depth)), [-1] + [0] * depth
    for i in range(total_tokens - depth):
        parents.append(i % depth)
        ranks.append(1 + i // depth)
    return Tree(parents=tuple(parents), ranks=tuple(ranks))


def is_chain(tree: Tree) -> bool:
    return tree == chain(tree.num_drafts)


class EagleDrafter:
    """EAGLE-1 / EAGLE-3 drafter for the drafter protocol (eval.drafters.Drafter), with its own KV cache.

    feature_layers: the M_q hidden states it reads, as indices into HF's `hidden_states` (None: the last layer);
        the decode loop returns them concatenated from the same verifier forward.
    topk: children expanded per frontier node, and frontier nodes per depth, of a dynamic tree.
    with_probs: also return p, the draft distribution each node was taken from (over M_q's vocabulary).
    """

    def __init__(self, net: EagleDrafterNet, verifier: Verifier, topk: int = DEFAULT_TOPK,
                 depth: int = DEFAULT_DEPTH, total_tokens: int = DEFAULT_TOTAL_TOKENS, with_probs: bool = False,
                 config: dict[str, Any] | None = None) -> None:
        if topk < 1:
            raise UserError(f"EAGLE topk={topk} must be >= 1.")
        self.net = net.eval().requires_grad_(False)
        self.embed, self.lm_head = verifier.model.get_input_embeddings(), verifier.lm_head
        self.topk, self.with_probs, self.config = min(topk, net.draft_vocab_size), with_probs, config or {}
        self.default_tree = budget_tree(depth, total_tokens)
        self.feature_layers: tuple[int, ...] | None = tuple(net.aux_layer_ids) if net.kind == "eagle3" else None
        self._k: Tensor | None = None  # (B, H_kv, P, hd) step-0 keys of the committed positions 0..P-1
        self._v: Tensor | None = None
        self._next: int | None = None  # positions the next round must bring (1 + accepted), for a sync check

    @property
    def cache_length(self) -> int:
        """Committed positions whose step-0 keys are cached (= tokens so far minus the root)."""
        return 0 if self._k is None else self._k.shape[2]

    # -- 1. the committed prefix -----------------------------------------------------------------------------------
    def _extend(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        """Add step-0 keys for the S newly committed positions; return the output at the last one. (B, D)"""
        bsz, s = hidden.shape[:2]
        n = input_ids.shape[1] - 1  # positions with known features once this round's are in
        start = n - s
        if start == 0:  # a new sequence (the prefill): forget the last one
            self._k = self._v = self._next = None
        elif start != self.cache_length or (self._next is not None and s != self._next):
            raise UserError(f"EAGLE drafter out of step: it caches {self.cache_length} positions but was handed "
                            f"{s} new features ending at position {n - 1}. Call propose/accepted as "
                            f"eval.decode.speculative_decode does, one sequence at a time.")
        names = self.feature_layers or (-1,)
        layers = dict(zip(names, hidden.split(hidden.shape[-1] // len(names), dim=-1)))
        feats = self.net.features(layers)  # (B, S, D): F_t, t = start..n-1
        emb = self.embed(input_ids[:, start + 1 : n + 1])  # (B, S, D): x_{t+1}, the last is the root
        pos = torch.arange(start, n, device=input_ids.device)
        mask = (torch.arange(n, device=pos.device)[None, :] <= pos[:, None])[None, None].expand(bsz, 1, s, n)
        out, k, v = self.net.step(feats, emb, pos[None].expand(bsz, s), mask, self._k, self._v)
        self._k = k if self._k is None else torch.cat([self._k, k], dim=2)  # (B, H_kv, n, hd)
        self._v = v if self._v is None else torch.cat([self._v, v], dim=2)
        return out[:, -1]

    # -- 2. drafting -------------------------------------------------------------------------------------------------
    def _expand(self, root_out: Tensor, depth: int, topk: int, total: int) -> tuple[Tree, Tensor, Tensor | None]:
        """Grow the tree under the root; returns (tree, draft-vocab tokens (N-1,), p rows (N, V_draft) or None)."""
        dev, pos0 = root_out.device, self.cache_length - 1  # the root's step-0 output sits at position P-1
        logp = self.net.logits(root_out, self.lm_head).float().log_softmax(-1)  # (1, Vd)
        top = logp.topk(topk, dim=-1)  # the root's children
        # Candidates in creation order (parents first): draft token, cumulative log-prob, parent (-1 = root), rank.
        tok, score = top.indices[0], top.values[0]  # (C,)
        parent, rank = torch.full((topk,), -1, device=dev), torch.arange(topk, device=dev)
        rows = [logp] if self.with_probs else []  # log p of the root's children, then of each fed node's
        row_of, out_of, slot_of = {-1: 0}, {-1: root_out[0]}, {}  # per fed candidate: row, output, key slot
        sk = sv = None  # keys of the fed nodes (1, H_kv, F, hd)
        anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # (F, F) ancestor-or-self among fed nodes
        layer_lo = 0
        for d in range(1, depth):
            # 1. Frontier: the topk best nodes of the deepest layer by cumulative log-prob.
            layer = score[layer_lo:]
            pick = (layer.topk(min(topk, layer.numel())).indices + layer_lo).sort().values.tolist()
            m, f = len(pick), 0 if sk is None else sk.shape[2]
            # 2. One drafter forward over the frontier: (token, parent's output) at position P-1+d, each node
            #    seeing the cache, its fed ancestors and itself (the training unroll's step-d mask).
            ids = self.net.draft_to_target(tok[pick])[None]  # (1, m)
            hid = torch.stack([out_of[int(parent[c])] for c in pick])[None]  # (1, m, D)
            mine = torch.zeros(m, f + m, dtype=torch.bool, device=dev)
            for j, c in enumerate(pick):
                if int(parent[c]) >= 0:
                    mine[j, :f] = anc[slot_of[int(parent[c])]]
                mine[j, f + j] = True
                slot_of[c] = f + j
            anc = torch.cat([torch.cat([anc, anc.new_zeros(f, m)], dim=1), mine], dim=0)  # (F+m, F+m)
            mask = torch.cat([mine.new_ones(m, self.cache_length), mine], dim=1)[None, None]  # (1, 1, m, P+F+m)
            past_k = self._k if sk is None else torch.cat([self._k, sk], dim=2)
            past_v = self._v if sv is None else torch.cat([self._v, sv], dim=2)
            pos = torch.full((1, m), pos0 + d, device=dev)
            out, k, v = self.net.step(hid, self.embed(ids), pos, mask, past_k, past_v)  # out (1, m, D)
            sk = k if sk is None else torch.cat([sk, k], dim=2)
            sv = v if sv is None else torch.cat([sv, v], dim=2)
            # 3. Their children: topk each, scored by the cumulative log-prob of the whole path.
            logits = self.net.logits(out, self.lm_head).float()[0]  # (m, Vd)
            top = logits.topk(topk, dim=-1)
            lse = logits.logsumexp(dim=-1, keepdim=True)  # (m, 1): log_softmax of the top-k alone
            for j, c in enumerate(pick):
                out_of[c], row_of[c] = out[0, j], len(rows)
                if self.with_probs:
                    rows.append(logits[j : j + 1] - lse[j])
            child = score[pick][:, None] + (top.values - lse).clamp(max=0)  # (m, topk), <= the parent's score
            layer_lo = tok.numel()
            tok = torch.cat([tok, top.indices.flatten()])
            score = torch.cat([score, child.flatten()])
            parent = torch.cat([parent, torch.tensor(pick, device=dev).repeat_interleave(topk)])
            rank = torch.cat([rank, torch.arange(topk, device=dev).repeat(m)])
        # 4. Rerank: the `total` best candidates. Stable, so on a tie a parent (created first) stays ahead.
        keep = score.sort(descending=True, stable=True).indices[:total].sort().values  # back in creation order
        node_of = {-1: 0} | {c: i + 1 for i, c in enumerate(keep.tolist())}
        tree = Tree(parents=(-1,) + tuple(node_of[int(parent[c])] for c in keep),
                    ranks=(-1,) + tuple(int(r) for r in rank[keep]))
        p = None
        if self.with_probs:
            table = torch.cat(rows).exp()  # (1+F, Vd)
            p = torch.cat([table[:1], table[[row_of[int(parent[c])] for c in keep]]])  # (N, Vd)
        return tree, tok[keep], p

    @torch.no_grad()
    def propose(self, input_ids: Tensor, hidden: Tensor, logits: Tensor, tree: Tree) -> Draft:
        """Extend the drafter's cache with M_q's newly committed features, then draft a chain (`tree` is a chain)
        or a dynamic tree of `tree`'s depth and node count (any other tree, e.g. `budget_tree()`)."""
        if input_ids.shape[0] != 1:
            raise UserError(f"EAGLE drafting runs one sequence at a time; got batch size {input_ids.shape[0]}.")
        root_out = self._extend(input_ids, hidden)  # (1, D)
        root = input_ids[:, -1:]  # (1, 1)
        if tree.num_drafts == 0:
            return Draft(tree=tree, tokens=root)
        topk = 1 if is_chain(tree) else self.topk
        built, draft_ids, p = self._expand(root_out, tree.max_depth, topk, tree.num_drafts)
        tokens = torch.cat([root, self.net.draft_to_target(draft_ids).to(root.dtype)[None]], dim=1)  # (1, N)
        if p is not None and self.net.kind == "eagle3":  # onto M_q's vocabulary
            full = p.new_zeros(p.shape[0], self.net.vocab_size)
            full[:, self.net.draft_to_target(torch.arange(p.shape[1], device=p.device))] = p
            p = full
        return Draft(tree=built, tokens=tokens, p=None if p is None else p[None])

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Roll back to the accepted prefix. The cache already holds committed positions only (drafted keys never
        enter it), so this records that the next round brings 1 + num_accepted new positions."""
        self._next = 1 + int(num_accepted[0])


def make_eagle(kind: str, verifier: Verifier, checkpoint: str | Path | None = None,
               net: EagleDrafterNet | None = None, **kwargs: Any) -> EagleDrafter:
    """An EAGLE drafter of `kind` ('eagle' or 'eagle3') from an export (checkpoint=<dir>) or a net (net=...);
    kwargs: topk, depth, total_tokens (the default_tree budget), with_probs."""
    if (checkpoint is None) == (net is None):
        raise UserError(f"make_drafter({kind!r}, ...) needs exactly one of checkpoint=<export dir> or "
                        f"net=<EagleDrafterNet>.")
    config: dict[str, Any] = {}
    if checkpoint is not None:
        net, config = load_eagle_export(checkpoint, verifier, kind)
    elif net.kind != kind:
        raise UserError(f"net is an {NAMES[net.kind]} drafter but was given as {NAMES[kind]}; use "
                        f"make_drafter({net.kind!r}, ...).")
    return EagleDrafter(net.to(verifier.device), verifier, config=config, **kwargs)

"""EAGLE drafters at decode time (Li et al., 2024; EAGLE-2 dynamic trees, Li et al., 2024b; EAGLE-3, 2025).

Alignment, as in training (models.eagle.unroll): the drafter's step 0 at position t reads (token x_{t+1}, feature
F_t) and predicts x_{t+2}. When M_q has committed positions up to the token before the root, every feature F_t there
pairs with a known token x_{t+1} (the last with the root itself), so each round the drafter first extends its own
KV cache with step-0 keys for exactly the positions M_q just committed, then drafts: the step-0 output at the last
one gives the root's children; a drafted node at depth d reads (its token, its parent's output) at rotary position
(P - 1 + d) for a cache of P positions, and attends the cache, its drafted ancestors and itself -- what step d of the
training-time unroll sees. Drafted keys come from predicted features, never the verifier's, so they live only inside
one `propose`: the cache keeps committed step-0 keys alone, and the next round recomputes the accepted tokens' keys
from M_q's true features (the rollback EAGLE does).

Trees: one growth procedure for every policy. From the root, expand the `topk` children of the `topk` best frontier
nodes by cumulative log-probability, one batched drafter forward per depth, then keep the `size` best of all drafted
nodes (a child never beats its parent, so the kept set is a tree). A chain is topk 1; `AutoTree(size)` is a dynamic
tree with the default topk (docs/results/families.md says how those were measured), as deep as the default or, with
the export's acceptance table, as deep as the tree that table buys for `size` drafts (eval.engine.tree.auto_tree): the
depth tree.size=auto priced when it chose `size` (`trial`). Sampled drafts
(sampled_drafts=true) grow the same frontier, but draw children without replacement and keep every one drawn, the
budget spent layer by layer (`EagleDrafter._sample_tree` says why that keeps the sampling rule exact).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from eval.drafters.heads import weights_dtype
from eval.drafters.online import AdaptSettings, OnlineLearner
from eval.drafters.verifier_fed import VerifierFedDrafter
from eval.engine.acceptance.sampled import sibling_proposals, without_replacement
from eval.engine.protocol import Draft
from eval.engine.sampling import SamplingConfig, warp
from eval.engine.tree import AutoTree, Chain, DynamicTree, Tree, TreePolicy, auto_tree
from models.eagle import EagleNet, unroll
from models.verifiers.core import Verifier
from runtime.errors import UserError

DEFAULT = DynamicTree()  # depth 5, topk 16, 24 nodes


def dynamic_policy(policy: TreePolicy) -> DynamicTree:
    """Any tree policy an EAGLE drafter can draft, as the dynamic-tree settings that grow it."""
    if isinstance(policy, DynamicTree):
        return policy
    if isinstance(policy, Chain):
        depth = DEFAULT.depth if policy.depth is None else policy.depth
        return DynamicTree(size=depth, depth=max(depth, 1), topk=1)
    if isinstance(policy, AutoTree):
        return DynamicTree(size=policy.size, depth=DEFAULT.depth, topk=DEFAULT.topk)
    raise UserError(f"tree={type(policy).__name__} does not fit an EAGLE drafter, which grows its tree each round "
                    f"from its own scores; use tree=chain, tree=auto or tree=dynamic.")


class EagleDrafter(VerifierFedDrafter):
    """EAGLE-1 / EAGLE-3 drafter for the drafter protocol (eval.engine.protocol.Drafter): the verifier-fed drafter's
    step-0 cache (eval/drafters/verifier_fed.py), then a tree grown depth by depth.

    tree: a Chain, an AutoTree budget or a DynamicTree (see `dynamic_policy`).
    sampling: with a SamplingConfig of temperature > 0, drafts are sampled from the drafter's warped softmax at
        their parent instead of taken by rank, siblings without replacement (`_sample_tree`), and `Draft.p` carries
        the distribution each was drawn from over the verifier's vocabulary (EAGLE-3's draft vocabulary mapped
        through d2t, every other token 0). Without it, top-k drafts, which the sampling rule treats as one-hot p.
    table: the export's acceptance estimates (a per-depth cumulative top-k table, ExportInfo.acceptance). Under an
        AutoTree budget the tree grows no deeper than `auto_tree(table, size)`, the tree tree.size=auto plans and
        prices (eval.planner.cost.best_size over `trial`'s times): without the cap a confident drafter grows a
        size-deep chain each round, a drafter forward per depth the plan never paid for.
    """

    def __init__(self, net: EagleNet, verifier: Verifier, tree: TreePolicy = DEFAULT,
                 sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                 head_ids: Tensor | None = None, table: list[list[float]] | None = None) -> None:
        super().__init__(net, verifier, sampling=sampling, generator=generator, head_ids=head_ids)
        self.policy = tree
        grow = dynamic_policy(tree)
        self.size, self.depth, self.topk = grow.size, grow.depth, min(grow.topk, self.head_size)
        self.table = table if isinstance(tree, AutoTree) and table else None
        self.depth = self.planned_depth(self.size)
        self.max_nodes, self.max_depth = 1 + self.size, min(self.depth, self.size)
        self.learner: OnlineLearner | None = None  # drafter.adapt=online (learn_online)
        self._verifier = verifier

    def learn_online(self, settings: AdaptSettings) -> None:
        """eval.drafters.online.Adaptable: learn from the verifier's tokens while decoding, from now on, on a copy of
        the network (an export's network is shared by the drafters built from it)."""
        self.net, self._step = copy.deepcopy(self.net), None
        self.learner = OnlineLearner(self.net, self.embed, self._verifier.lm_head, settings,
                                     autocast=self._verifier.dtype == torch.bfloat16)

    def planned_depth(self, drafts: int) -> int:
        """How deep a tree of `drafts` drafts grows: the policy's depth, capped under tree=auto with the export's table
        at the depth of the tree that table buys for `drafts` (auto_tree)."""
        if self.table is None or drafts == 0:
            return self.depth
        return min(self.depth, auto_tree(self.table, drafts).max_depth)

    def describe(self) -> dict[str, Any]:
        policy = {Chain: "chain", AutoTree: "auto", DynamicTree: "dynamic"}[type(self.policy)]
        return {"policy": policy, "proposals": "sampled" if self.sampling else "topk",
                "weights": weights_dtype(self.net), "dynamic": self.topk > 1,
                "size": self.size, "depth": self.max_depth, "topk": self.topk, "max_nodes": self.max_nodes,
                **({"learning": self.learner.describe()} if self.learner is not None else {})}

    def _logits(self, out: Tensor) -> Tensor:
        """The drafting head over outputs (m, D) -> (m, V_draft): `net.logits`, EAGLE-3's own head through
        `DecodeStep.logits` (where the instance's logits were not replaced)."""
        if self.net.shares_verifier_head or "logits" in vars(self.net):
            return self.net.logits(out[None], self.lm_head)[0]
        return self.fast.logits(out)

    # -- 2. drafting -------------------------------------------------------------------------------------------------
    def _expand(self, root_out: Tensor, depth: int, topk: int, total: int,
                bound_frontier: bool = True, worst_case: bool = False) -> tuple[Tree, Tensor]:
        """Grow the tree under the root from top-k drafts; returns (tree, verifier-vocabulary tokens (N-1,)).
        `bound_frontier=False` expands the topk best nodes of every layer, as EAGLE-2 does: the same tree (tested),
        at the cost of topk drafter rows and vocabulary-head rows per layer instead of at most min(topk, total -
        depth), of which only those that can still have a kept child. `worst_case=True` feeds every layer's
        min(topk, total - depth) best nodes whatever their scores (no early stop): the most drafting a round of this
        budget and depth can do, the same work on any prefix (what `trial` times)."""
        if topk == 1 and bound_frontier and self.fed_class is _Fed:  # a chain: the same drafts, no tree bookkeeping
            return self._chain(root_out, min(depth, total))
        dev = root_out.device
        fed = self.fed_class(self, root_out)
        self.rows_fed = 1  # drafter (and vocabulary-head) rows this call computes: the root, then each frontier
        logp = self._logits(root_out).float().log_softmax(-1)  # (1, Vd)
        top = logp.topk(topk, dim=-1)  # the root's children
        # Candidates in creation order (parents first): draft token, cumulative log-prob, parent (-1 = root), rank.
        tok, score = top.indices[0], top.values[0]  # (C,)
        parent, rank = torch.full((topk,), -1, device=dev), torch.arange(topk, device=dev)
        layer_lo = 0
        for d in range(1, depth):
            # 1. Frontier: the topk best nodes of the deepest layer (depth d) by cumulative log-prob, and no more
            #    than total - d of them. For a child of a node of layer rank r to be kept, the kept set must hold the
            #    r better nodes of its layer, the node, its d - 1 ancestors (each scores at least as high) and the
            #    child: r + d + 1 <= total. So the rest can never have a kept child, and expanding them would only
            #    cost drafter rows and vocabulary-wide head rows; at total <= d nothing deeper can be kept.
            layer = score[layer_lo:]
            width = min(topk, total - d, layer.numel()) if bound_frontier else min(topk, layer.numel())
            if width <= 0:
                break
            pick = layer.topk(width).indices + layer_lo
            if bound_frontier and not worst_case and score.numel() >= total:
                # ... and only nodes that beat the total-th best candidate so far: a child scores at most its parent,
                # and, created after every candidate already there, loses a tie to them in the stable rerank, so the
                # children of a node scoring <= that threshold can never be kept (the threshold only rises).
                pick = pick[score[pick] > score.topk(total).values[-1]]
                if pick.numel() == 0:
                    break
            pick = pick.sort().values.tolist()
            self.rows_fed += len(pick)
            # 2. One drafter forward over the frontier (eval.drafters.eagle._Fed).
            out = fed.feed(pick, self.to_verifier(tok[pick]), [int(parent[c]) for c in pick], d)  # (m, D)
            # 3. Their children: topk each, scored by the cumulative log-prob of the whole path.
            logits = self._logits(out).float()  # (m, Vd)
            top = logits.topk(topk, dim=-1)
            lse = logits.logsumexp(dim=-1, keepdim=True)  # (m, 1): log_softmax of the top-k alone
            child = score[pick][:, None] + (top.values - lse).clamp(max=0)  # (m, topk), <= the parent's score
            layer_lo = tok.numel()
            tok = torch.cat([tok, top.indices.flatten()])
            score = torch.cat([score, child.flatten()])
            parent = torch.cat([parent, torch.tensor(pick, device=dev).repeat_interleave(topk)])
            rank = torch.cat([rank, torch.arange(topk, device=dev).repeat(len(pick))])
        # 4. Rerank: the `total` best candidates. Stable, so on a tie a parent (created first) stays ahead.
        keep = score.sort(descending=True, stable=True).indices[:total].sort().values  # back in creation order
        node_of = {-1: 0} | {c: i + 1 for i, c in enumerate(keep.tolist())}
        tree = Tree(parents=(-1,) + tuple(node_of[int(parent[c])] for c in keep),
                    ranks=(-1,) + tuple(int(r) for r in rank[keep]))
        return tree, self.to_verifier(tok[keep])

    def _chain(self, root_out: Tensor, drafts: int) -> tuple[Tree, Tensor]:
        """`_expand` at topk 1 (tree=chain): the same `drafts` tokens and tree, without the tree's bookkeeping. Each
        depth's one node has a known parent (the node before), position (P - 1 + d), mask (every cached slot and the
        chain so far) and key slot (P + d - 1), so no ancestor matrix, candidate lists or rerank are built: per depth
        one drafter forward, one head call and its top-1 (tests/test_eagle_decode.py holds it to `_expand`'s path)."""
        dev, p = root_out.device, self.cache_length
        self._kv.adopt(self._k, self._v)
        self.rows_fed = 1
        tok = self._logits(root_out).float().log_softmax(-1).topk(1, dim=-1).indices[0]  # (1,), as _expand ranks it
        toks, carried = [tok], self.net.carry(root_out)  # (1, D): what the root passes to its child
        mask = torch.ones(1, 1, 1, p + drafts, dtype=torch.bool, device=dev)
        for d in range(1, drafts):
            self.rows_fed += 1
            out = self._forward(carried[None], self.embed(self.to_verifier(tok)[None]),
                                torch.full((1,), p - 1 + d, device=dev), mask[..., : p + d], p + d - 1)  # (1, 1, D)
            carried = self.net.carry(out)[0]
            tok = self._logits(out[0]).float().topk(1, dim=-1).indices[0]
            toks.append(tok)
        tree = Tree(parents=(-1,) + tuple(range(len(toks))), ranks=(-1,) + (0,) * len(toks))
        return tree, self.to_verifier(torch.cat(toks))

    def _full_probs(self, out: Tensor) -> Tensor:
        """The drafter's warped distribution over the verifier's vocabulary. (m, D) -> (m, V)"""
        logits = self._logits(out).float()  # (m, Vd)
        if logits.shape[-1] != self.vocab_size:  # a draft vocabulary: draft ids -> verifier ids, the rest impossible
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            ids = self.to_verifier(torch.arange(logits.shape[-1], device=logits.device))
            logits = full.index_copy_(1, ids, logits)
        s = self.sampling
        return warp(logits, s.temperature, s.top_p, s.top_k)

    def _sample_tree(self, root_out: Tensor, depth: int, topk: int, total: int) -> tuple[Tree, Tensor, Tensor]:
        """Grow the tree under the root from sampled drafts; returns (tree, verifier-vocabulary tokens (N-1,), the
        distribution each was drawn from (N-1, V)). A chain is topk 1.

        Each expanded node u draws its m_u children one after another without replacement from its warped p_u
        (eval.engine.acceptance.sampled.without_replacement), and child i carries p_u with its earlier siblings removed
        (eval.engine.acceptance.sampled.sibling_proposals): what recursive rejection sampling needs to stay exact.
        Every sampled child is kept: pruning a child by its own token (as the top-k growth's rerank does) would bias
        the kept ones away from p_u. The shape depends on the drafts in one way only: m_u = min(topk, p_u's support,
        budget left) is fixed before u's children are drawn (sufficient; whether child i exists may depend on its
        earlier siblings, never on itself or later ones), from the drafts of u's layer and above (the frontier is the
        topk best nodes of a layer by cumulative log p, any deterministic function of them would do; the node budget
        is spent layer by layer, best parent first). Given those, u's children are a fresh draw from p_u, so at every
        node the children the walk tries follow the p it is handed. Spending the budget breadth-first matters: were a
        deeper node's group allowed to claim budget before u's, whether that node was expanded (which depends on u's
        children's scores) would decide m_u."""
        dev = root_out.device
        fed = self.fed_class(self, root_out)
        # Candidates in creation order (parents first, siblings together): token (verifier id), parent (-1 = root),
        # the distribution it was drawn from, cumulative log p.
        tokens: list[int] = []
        parents: list[int] = []
        dists: list[Tensor] = []
        scores: list[float] = []
        left, frontier, outs = total, [-1], root_out  # budget; the nodes to expand and their outputs (m, D)
        for d in range(1, depth + 1):
            # 1. Children of the frontier, best parent first while the budget lasts, all drawn before any is fed.
            p = self._full_probs(outs)  # (m, V)
            base = [0.0 if c < 0 else scores[c] for c in frontier]
            layer_lo = len(tokens)
            for j in sorted(range(len(frontier)), key=lambda j: -base[j]):  # stable: creation order on ties
                if left == 0:
                    break
                kids = without_replacement(p[j], min(topk, left), self.generator)  # (m_u,) in draw order
                dists.extend(sibling_proposals(p[j], kids))
                scores.extend((base[j] + p[j, kids].double().log()).tolist())
                tokens.extend(kids.tolist())
                parents.extend([frontier[j]] * len(kids))
                left -= len(kids)
            layer = list(range(layer_lo, len(tokens)))
            if d == depth or left == 0 or not layer:
                break
            # 2. The next frontier: the topk best of this layer by cumulative log p, fed in one drafter forward.
            frontier = sorted(sorted(layer, key=lambda c: -scores[c])[:topk])
            ids = torch.tensor([tokens[c] for c in frontier], device=dev)
            outs = fed.feed(frontier, ids, [parents[c] for c in frontier], d)
        ranks, seen = [], {}
        for parent in parents:
            seen[parent] = seen.get(parent, -1) + 1
            ranks.append(seen[parent])
        tree = Tree(parents=(-1,) + tuple(c + 1 for c in parents), ranks=(-1,) + tuple(ranks))
        return tree, torch.tensor(tokens, device=dev), torch.stack(dists)

    @torch.no_grad()
    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        """Extend the drafter's cache with M_q's newly committed features, then grow this round's tree."""
        if input_ids.shape[0] != 1:
            raise UserError(f"EAGLE drafting runs one sequence at a time; got batch size {input_ids.shape[0]}.")
        if self.learner is not None and self.learner.committed(input_ids, hidden):
            self._step = None  # the fused decode layer is rebuilt from the updated weights
        root_out = self._extend(input_ids, hidden)  # (1, D)
        root = input_ids[:, -1:]  # (1, 1)
        if self.size == 0:
            return Draft(tree=Tree(parents=(-1,), ranks=(-1,)), tokens=root)
        if self.sampling is not None:
            tree, drafts, p = self._sample_tree(root_out, self.depth, self.topk, self.size)  # (n,), (n, V)
            p = torch.cat([torch.zeros_like(p[:1]), p])[None]  # (1, N, V), row 0 unused
            return Draft(tree=tree, tokens=torch.cat([root, drafts.to(root.dtype)[None]], dim=1), p=p)
        tree, drafts = self._expand(root_out, self.depth, self.topk, self.size)
        return Draft(tree=tree, tokens=torch.cat([root, drafts.to(root.dtype)[None]], dim=1))  # (1, N)

    @torch.no_grad()
    def trial(self, input_ids: Tensor, hidden: Tensor, drafts: int) -> Tree | None:
        """One round's drafting as a drafter of `drafts` drafts does it (feed the new features, grow `drafts` nodes
        as deep as `planned_depth(drafts)`), at its most: every depth's frontier as wide as the budget lets it be,
        however the scores fall (`_expand(worst_case=True)`), so what eval.planner.cost.draft_curve times is the round
        the plan pays for, not however deep this one prefix happens to grow. Leaves the drafter's cache as it was."""
        keys = self._k, self._v
        try:
            root_out = self._extend(input_ids, hidden)
            if drafts == 0:
                return None
            depth = self.planned_depth(drafts)
            if self.sampling is not None:
                return self._sample_tree(root_out, depth, self.topk, drafts)[0]
            return self._expand(root_out, depth, self.topk, drafts, worst_case=True)[0]
        finally:
            self._k, self._v = keys


class _Fed:
    """The drafted nodes fed to the drafter within one `propose`: their keys (in the drafter's buffers after the
    committed slots, overwritten by the next round: they never enter its cache, module docstring), outputs and
    ancestor masks."""

    def __init__(self, drafter: EagleDrafter, root_out: Tensor) -> None:
        self.drafter, dev = drafter, root_out.device
        drafter._kv.adopt(drafter._k, drafter._v)
        # what each fed node passes to its children (its output, or the final-normed one: net.carry): row 0 the
        # root's, row 1 + slot a fed node's
        self.carried = drafter.net.carry(root_out)  # (1 + F, D)
        self.slot_of: dict[int, int] = {}
        self.anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # (F, F) ancestor-or-self among fed nodes

    def feed(self, nodes: list[int], ids: Tensor, parents: list[int], depth: int) -> Tensor:
        """One drafter forward over `nodes` (their verifier-vocabulary tokens `ids` (m,), parents -1 = the root), all
        at `depth`: (token, parent's output) at position P-1+depth, each seeing the cache, its fed ancestors and
        itself (the training unroll's step-d mask). Returns their outputs. (m, D)"""
        d, dev = self.drafter, ids.device
        m, f, p = len(nodes), self.anc.shape[0], d.cache_length
        slot = torch.tensor([self.slot_of.get(c, -1) for c in parents], device=dev)  # (m,) -1: the root
        seen = self.anc[slot.clamp(min=0)] & (slot >= 0)[:, None] if f else self.anc.new_zeros(m, 0)  # (m, F)
        mine = torch.cat([seen, torch.eye(m, dtype=torch.bool, device=dev)], dim=1)  # (m, F+m)
        self.slot_of.update((c, f + j) for j, c in enumerate(nodes))
        self.anc = torch.cat([torch.cat([self.anc, self.anc.new_zeros(f, m)], dim=1), mine], dim=0)  # (F+m, F+m)
        mask = torch.cat([mine.new_ones(m, p), mine], dim=1)[None, None]  # (1, 1, m, P+F+m)
        pos = torch.full((m,), p - 1 + depth, device=dev)
        hid = self.carried[slot + 1][None]  # (1, m, D)
        out = d._forward(hid, d.embed(ids[None]), pos, mask, p + f)  # (1, m, D)
        self.carried = torch.cat([self.carried, d.net.carry(out)[0]])
        return out[0]


EagleDrafter.fed_class = _Fed  # what _expand / _sample_tree feed the drafted nodes through


def eagle_drafter(net: EagleNet, config: dict[str, Any], verifier: Verifier, tree: TreePolicy,
                  sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                  head_ids: Tensor | None = None) -> EagleDrafter:
    """The drafter for a loaded EAGLE-1 / EAGLE-3 network (models/families.py names it the families' decoder), its
    tree=auto depth capped by the export's acceptance table."""
    from models.exports.io import acceptance_table
    from models.families import family_of_net

    return EagleDrafter(net, verifier, tree, sampling=sampling, generator=generator, head_ids=head_ids,
                        table=acceptance_table(config, family_of_net(net)))


def eagle_ranks(net: EagleNet, verifier: Verifier, batch: dict[str, Tensor], depth: int,
                keep: Tensor | None = None) -> tuple[Tensor, ...]:
    """Teacher-forced scoring (eval.offline.score_export; the registry's `teacher_forced`) of an EAGLE drafter,
    unrolled `depth` steps exactly as in training: (D, B, T) ranks, validity and top-1 probability, as
    eval.drafters.medusa.medusa_ranks; the target of step j at position t is M_q's argmax at t+j+1."""
    from data.hidden_cache import gather_layers
    from eval.drafters.scoring import keep_only, rank_rows

    layers = list(dict.fromkeys([*net.feature_layers, -1]))
    states = gather_layers(batch, layers, verifier, layers)
    ids, n = batch["input_ids"], batch["input_ids"].shape[1] - 1
    q_arg = verifier.lm_head(states[-1]).argmax(-1)  # (B, T): M_q's greedy token after each position
    embed, vocab = verifier.token_embedding, verifier.vocab_size
    ranks, valids, confs = [], [], []
    steps = unroll(net, net.features(states)[:, :n], ids, batch["attention_mask"], batch["loss_mask"].bool(), embed,
                   depth)
    for j, step in enumerate(steps):
        valid, bi, ti = step.valid, step.batch, step.position
        logits = keep_only(net.logits(step.at_targets, verifier.lm_head).float(), keep)  # (N, V_draft)
        rank, conf = rank_rows(logits, q_arg[bi, ti + j + 1], valid, vocab, net.target_rank)
        pad = lambda x, v: torch.cat([x, x.new_full((x.shape[0], 1), v)], dim=1)  # (B, n) -> (B, T)
        ranks.append(pad(rank, vocab))
        valids.append(pad(valid, False))
        confs.append(pad(conf, 0.0))
    return torch.stack(ranks), torch.stack(valids), torch.stack(confs)

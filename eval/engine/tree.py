"""Draft trees as data: structure built by small functions, tokens filled by a drafter each round.

Node 0 is the root: the token the verifier M_q chose last round (or after the prompt), not yet in its KV cache.
Every other node is one draft token at depth d >= 1, i.e. at position (cache length + d). `ranks[i]` says which
candidate of the drafter node i takes: for Medusa (Cai et al., 2024) the rank-th most likely token of head d-1, for a
drafter that conditions on the path (EAGLE) the rank-th most likely child of its parent.

Medusa notation (`medusa_choices`): a node is the tuple of ranks along its path from the root, e.g. (0, 1) is the
second-best token of head 1 under the best token of head 0. The root is the empty tuple and is never listed.

Tree policies (`conf/tree/*.yaml`, instantiated by Hydra and handed to the drafter factory) say what shape a drafter
proposes: a fixed `Tree` (e.g. `from_medusa_choices`), a `Chain`, an `AutoTree` node budget, or an EAGLE-2
`DynamicTree`. The drafter turns its policy into the tree of each round; one it cannot draft is refused there.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from runtime.errors import UserError


@dataclass(frozen=True)
class Tree:
    """Tree structure: `parents[i]` (-1 for the root, always < i) and `ranks[i]` (-1 for the root)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1 or len(self.ranks) != len(self.parents):
            raise UserError(f"A tree needs a root (parents[0] == -1) and one rank per node; got {self}.")
        seen: set[tuple[int, int]] = set()
        for i, (parent, rank) in enumerate(zip(self.parents[1:], self.ranks[1:]), start=1):
            if not 0 <= parent < i or rank < 0:
                raise UserError(
                    f"Tree node {i} has parent {parent} and rank {rank}: parents must come first, ranks be >= 0."
                )
            if (parent, rank) in seen:
                raise UserError(
                    f"Tree node {i} repeats rank {rank} under parent {parent}: siblings need distinct ranks."
                )
            seen.add((parent, rank))

    @property
    def num_nodes(self) -> int:
        """Nodes including the root; the verifier forward runs over this many tokens."""
        return len(self.parents)

    @property
    def num_drafts(self) -> int:
        return len(self.parents) - 1

    @cached_property
    def depths(self) -> tuple[int, ...]:
        out = [0]
        for parent in self.parents[1:]:
            out.append(out[parent] + 1)
        return tuple(out)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Each node's rank path from the root (Medusa notation); the root's is ()."""
        out: list[tuple[int, ...]] = [()]
        for parent, rank in zip(self.parents[1:], self.ranks[1:]):
            out.append(out[parent] + (rank,))
        return tuple(out)

    def to_medusa_choices(self) -> list[tuple[int, ...]]:
        return list(self.paths[1:])


def truncate(tree: Tree, depth: int) -> tuple[Tree, list[int]]:
    """The nodes of `tree` at depth <= `depth` (the root always), as a tree, and their indices in `tree`, in order.
    Parents come before their children, so the kept nodes keep their relative order and their parents."""
    if depth < 0:
        raise UserError(f"truncate(depth={depth}): the depth must be >= 0.")
    keep = [i for i, d in enumerate(tree.depths) if d <= depth]
    index = {old: new for new, old in enumerate(keep)}
    parents = tuple(index.get(tree.parents[i], -1) for i in keep)
    return Tree(parents=parents, ranks=tuple(tree.ranks[i] for i in keep)), keep


@dataclass(frozen=True)
class Chain:
    """A chain of `depth` top-1 drafts; None: the drafter's own depth (every Medusa head, EAGLE's default depth)."""

    depth: int | None = None

    def __post_init__(self) -> None:
        if self.depth is not None and self.depth < 0:
            raise UserError(f"tree.depth={self.depth} must be >= 0 (or null for the drafter's own depth).")


@dataclass(frozen=True)
class AutoTree:
    """The `size` draft nodes of highest expected acceptance by the drafter's own estimates: Medusa grows a fixed
    tree from its export's per-head top-k accuracies (`auto_tree`); EAGLE grows an EAGLE-2 dynamic tree of at most
    `size` nodes each round from its scores (default topk; as deep as `auto_tree` of its export's table for `size`,
    else the default depth). `size=0` drafts nothing: plain decoding.
    `size="auto"`: the budget that maximises expected tokens/s from the verifier's measured cost curve and the
    drafter's acceptance estimates (eval.planner.cost.best_size; the harness resolves it before building the
    drafter)."""

    size: int | str = 16

    def __post_init__(self) -> None:
        if isinstance(self.size, str):
            if self.size != "auto":
                raise UserError(f"tree.size={self.size!r} must be a whole number of draft nodes or 'auto'.")
            return
        if self.size < 0:
            raise UserError(f"tree.size={self.size} must be >= 0 (0 drafts nothing).")


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree (Li et al., 2024b), rebuilt every round: expand the `topk` best children of the `topk`
    best frontier nodes by cumulative log-probability for `depth` levels, keep the `size` best draft nodes."""

    size: int = 24
    depth: int = 5
    topk: int = 16

    def __post_init__(self) -> None:
        if self.size < 0 or self.depth < 1 or self.topk < 1:
            raise UserError(f"tree=dynamic needs size >= 0, depth >= 1 and topk >= 1; got size={self.size}, "
                            f"depth={self.depth}, topk={self.topk}.")


TreePolicy = Tree | Chain | AutoTree | DynamicTree


def describe(tree: Tree) -> dict[str, object]:
    """A fixed tree as report.json records it."""
    return {"num_nodes": tree.num_nodes, "max_depth": tree.max_depth,
            "medusa_choices": [list(c) for c in tree.to_medusa_choices()]}


@dataclass(frozen=True)
class TreeBuffers:
    """What one verifier forward over a tree needs, as tensors.

    mask: (N, N) bool, node i attends to node j iff j is i or an ancestor of i (the cached prefix is always visible).
    positions: (N,) long, position offset of each node after the cached prefix (= its depth).
    retrieve: (L, D+1) long, one row per leaf: node indices of its root-to-leaf path, right-padded with -1.
    """

    mask: Tensor
    positions: Tensor
    retrieve: Tensor


def chain(n: int) -> Tree:
    """A root and `n` draft tokens in a line, each the top-1 candidate (what a draft model or EAGLE-1 proposes)."""
    if n < 0:
        raise UserError(f"chain(n={n}): the number of draft tokens must be >= 0.")
    return Tree(parents=tuple(range(-1, n)), ranks=(-1,) + (0,) * n)


def from_medusa_choices(choices: Sequence[Sequence[int]]) -> Tree:
    """Build a tree from Medusa choices, e.g. [(0,), (0, 0), (1,), (0, 1)].

    Nodes are ordered by depth, then by rank path (as the reference Medusa does); every choice's prefix must be
    listed too, so that each node has its parent in the tree.
    """
    try:
        paths = [tuple(_rank(r) for r in c) for c in choices]
    except (TypeError, ValueError) as e:
        raise UserError(f"medusa_choices={list(choices)!r} is not a list of lists of whole-number ranks ({e}); "
                        f"write e.g. [[0], [1], [0, 0]].") from None
    if any(len(p) == 0 for p in paths):
        raise UserError("medusa_choices contains an empty tuple; the root is implicit, list only draft nodes.")
    if len(set(paths)) != len(paths):
        raise UserError(f"medusa_choices lists a node twice: {sorted(p for p in paths if paths.count(p) > 1)}.")
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, ranks = [-1], [-1]
    for path in sorted(paths, key=lambda p: (len(p), p)):
        if path[:-1] not in index:
            raise UserError(
                f"medusa_choices has {path} but not its parent {path[:-1]}; add the parent or drop the node."
            )
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
    return Tree(parents=tuple(parents), ranks=tuple(ranks))


def _rank(r: object) -> int:
    if isinstance(r, bool) or not isinstance(r, int):
        raise ValueError(f"rank {r!r} is not a whole number")
    return r


def rank_probs(topk_accuracy: Sequence[Sequence[float]]) -> list[list[float]]:
    """P(rank r of head k is the right token) from cumulative top-k accuracies: acc[k][r] - acc[k][r-1]."""
    if not topk_accuracy or any(not row for row in topk_accuracy):
        raise UserError(
            f"topk_accuracy must hold, per head, a non-empty list of cumulative top-1..top-R accuracies; "
            f"got {topk_accuracy!r}."
        )
    out = []
    for k, row in enumerate(topk_accuracy):
        if any(not 0.0 <= a <= 1.0 for a in row):
            raise UserError(f"topk_accuracy[{k}]={list(row)} has values outside [0, 1]; pass accuracies, not percents.")
        prev = [0.0] + list(row[:-1])
        # A non-monotone row (noise in a small eval) would give negative probabilities; treat those as zero.
        out.append([max(a - b, 0.0) for a, b in zip(row, prev)])
    return out


def auto_tree(topk_accuracy: Sequence[Sequence[float]], size: int) -> Tree:
    """The `size` draft nodes of highest expected acceptance, chosen greedily (Medusa's sparse-tree construction).

    A node's value is the probability that its whole path is accepted, taken as the product over its depth d of
    P(rank r_d of head d-1 correct) = acc[d-1][r_d] - acc[d-1][r_d - 1]. A child's value never exceeds its parent's,
    so best-first growth from the root always adds a parent before its children.
    """
    return from_medusa_choices(best_first(topk_accuracy, size)[0])


def best_first(topk_accuracy: Sequence[Sequence[float]], size: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """auto_tree's nodes in the order it adds them (rank paths) and their values. The growth is the same for every
    size, so the tree of s drafts is the first s of the tree of `size`, and 1 + the cumulative sum of the values is
    E[tokens per round] of every smaller budget at once (eval.planner.cost.expected_curve)."""
    if size < 0:
        raise UserError(f"auto_tree(size={size}): the number of draft nodes must be >= 0.")
    probs = rank_probs(topk_accuracy)
    chosen: list[tuple[int, ...]] = []
    values: list[float] = []
    # Max-heap on value; ties broken by the shorter, then lexicographically smaller path, for a deterministic tree.
    heap: list[tuple[float, int, tuple[int, ...]]] = []

    def push_children(path: tuple[int, ...], value: float) -> None:
        if len(path) < len(probs):
            for rank, p in enumerate(probs[len(path)]):
                heapq.heappush(heap, (-value * p, len(path) + 1, path + (rank,)))

    push_children((), 1.0)
    while heap and len(chosen) < size:
        neg_value, _, path = heapq.heappop(heap)
        chosen.append(path)
        values.append(-neg_value)
        push_children(path, -neg_value)
    return chosen, values


def fixed_tree(policy: TreePolicy, depths: int, table: Sequence[Sequence[float]] | None, drafter: str,
               table_key: str) -> tuple[Tree, str]:
    """The tree of a drafter that drafts `depths` positions in one forward and proposes the same tree every round
    (Medusa's heads, a block drafter's slots, P-EAGLE's parallel tokens) under `policy`, and the policy's name.
    `table` is the export's top-k acceptance per depth (`table_key`, which tree=auto plans on); `drafter` names the
    drafter in messages."""
    if isinstance(policy, Tree):
        return policy, "tree"
    if isinstance(policy, Chain):
        return chain(depths if policy.depth is None else policy.depth), "chain"
    if isinstance(policy, AutoTree):
        if not table:
            raise UserError(f"tree=auto needs the top-k accuracies per depth the export records ({table_key}), and "
                            f"this {drafter} export has none: no validation of its final weights wrote them. Use "
                            f"tree=chain or tree=medusa_choices, or write them: python train.py <the run's overrides> "
                            f"ckpt_path=last validate_only=true.")
        return auto_tree(table[:depths], policy.size), "auto"
    raise UserError(f"tree={type(policy).__name__} does not fit a {drafter} drafter, whose tree is the same every "
                    f"round; use tree=chain, tree=auto or tree=medusa_choices.")


def tree_buffers(tree: Tree, device: torch.device | str | None = None) -> TreeBuffers:
    """Attention mask, position offsets and retrieve indices for one verifier forward over `tree`."""
    n = tree.num_nodes
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(tree.parents):
        if parent >= 0:
            mask[i] = mask[parent]  # a node sees what its parent sees (parents come first) ...
        mask[i, i] = True  # ... and itself
    is_parent = set(tree.parents[1:])
    leaves = [i for i in range(n) if i not in is_parent]
    leaves.sort(key=lambda i: tree.paths[i])  # depth-first order, so the best path ties break to low ranks
    width = tree.max_depth + 1
    retrieve = torch.full((len(leaves), width), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = tree.parents[node]
        retrieve[row, : len(path)] = torch.tensor(path[::-1])
    positions = torch.tensor(tree.depths, dtype=torch.long)
    return TreeBuffers(mask=mask.to(device), positions=positions.to(device), retrieve=retrieve.to(device))

"""Draft trees: Medusa choices, chains, the greedy auto tree, and the buffers one verifier forward needs."""

from __future__ import annotations

import pytest
import torch

from eval.engine.tree import Tree, auto_tree, chain, from_medusa_choices, tree_buffers, truncate
from runtime.errors import UserError


def test_medusa_choices_give_exact_buffers():
    # Root r; (0,) and (1,) are heads-0 ranks 0 and 1; (0,0), (0,1) hang under (0,).
    #        r=0
    #       /    \
    #   (0,)=1  (1,)=2
    #    /   \
    # (0,0)=3 (0,1)=4
    tree = from_medusa_choices([(0,), (0, 0), (1,), (0, 1)])
    assert tree.parents == (-1, 0, 0, 1, 1)
    assert tree.ranks == (-1, 0, 1, 0, 1)
    assert tree.depths == (0, 1, 1, 2, 2)
    assert tree.to_medusa_choices() == [(0,), (1,), (0, 0), (0, 1)]
    buf = tree_buffers(tree)
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(buf.mask, expected_mask)
    assert buf.positions.tolist() == [0, 1, 1, 2, 2]
    assert buf.retrieve.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, -1]]


def test_deeper_tree_buffers():
    tree = from_medusa_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 1)])
    assert tree.parents == (-1, 0, 0, 1, 2, 3, 3)
    buf = tree_buffers(tree)
    assert buf.positions.tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert buf.retrieve.tolist() == [[0, 1, 3, 5], [0, 1, 3, 6], [0, 2, 4, -1]]
    # Node 6 = (0,0,1) sees root, (0,), (0,0) and itself, not its sibling 5 nor the other branch.
    assert buf.mask[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert buf.mask[4].nonzero().flatten().tolist() == [0, 2, 4]


def test_chain():
    tree = chain(3)
    assert tree.parents == (-1, 0, 1, 2) and tree.ranks == (-1, 0, 0, 0)
    buf = tree_buffers(tree)
    assert torch.equal(buf.mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert buf.positions.tolist() == [0, 1, 2, 3]
    assert buf.retrieve.tolist() == [[0, 1, 2, 3]]
    assert tree_buffers(chain(0)).retrieve.tolist() == [[0]]
    assert chain(3) == from_medusa_choices([(0,), (0, 0), (0, 0, 0)])  # trees are values: usable as dict keys
    assert len({chain(3), from_medusa_choices([(0,), (0, 0), (0, 0, 0)])}) == 1


def test_auto_tree_picks_paths_by_product_of_rank_probabilities():
    # P(rank) per head: head 0 [0.6, 0.2], head 1 [0.5, 0.1].
    # Path values: (0,) .6, (0,0) .3, (1,) .2, (1,0) .1, (0,1) .06, (1,1) .02.
    acc = [[0.6, 0.8], [0.5, 0.6]]
    assert auto_tree(acc, 4).to_medusa_choices() == [(0,), (1,), (0, 0), (1, 0)]
    assert auto_tree(acc, 1).to_medusa_choices() == [(0,)]
    assert auto_tree(acc, 0).num_nodes == 1
    assert auto_tree(acc, 100).num_drafts == 6  # every node of a 2-head, top-2 tree


def test_auto_tree_keeps_parents_first_and_respects_depth():
    acc = [[0.7, 0.8, 0.85, 0.86], [0.5, 0.6, 0.62, 0.65], [0.4, 0.45, 0.5, 0.52], [0.3, 0.35, 0.4, 0.4]]
    tree = auto_tree(acc, 20)
    assert tree.num_drafts == 20 and tree.max_depth <= 4
    assert all(0 <= p < i for i, p in enumerate(tree.parents) if i)
    # Non-monotone accuracies (a noisy eval) must not produce negative values or crash.
    assert auto_tree([[0.5, 0.4, 0.6]], 3).num_drafts == 3


@pytest.mark.parametrize(
    "choices, message",
    [
        ([(0, 0)], "not its parent"),
        ([(0,), (0,)], "twice"),
        ([()], "empty tuple"),
    ],
)
def test_bad_medusa_choices_say_what_to_fix(choices, message):
    with pytest.raises(UserError, match=message):
        from_medusa_choices(choices)


def test_bad_inputs_are_refused():
    with pytest.raises(UserError, match="outside"):
        auto_tree([[50.0, 70.0]], 2)
    with pytest.raises(UserError, match="distinct ranks"):
        Tree(parents=(-1, 0, 0), ranks=(-1, 0, 0))
    with pytest.raises(UserError, match="parents must come first"):
        Tree(parents=(-1, 2, 0), ranks=(-1, 0, 1))


def test_truncate_keeps_the_nodes_up_to_a_depth_with_their_indices():
    tree = Tree(parents=(-1, 0, 1, 0, 3, 2), ranks=(-1, 0, 0, 1, 0, 0))  # depths 0, 1, 2, 1, 2, 3
    assert truncate(tree, 1) == (Tree(parents=(-1, 0, 0), ranks=(-1, 0, 1)), [0, 1, 3])
    assert truncate(tree, 2) == (Tree(parents=(-1, 0, 1, 0, 3), ranks=(-1, 0, 0, 1, 0)), [0, 1, 2, 3, 4])
    assert truncate(tree, 0) == (chain(0), [0])
    assert truncate(tree, 3) == (tree, list(range(6)))
    assert truncate(chain(4), 2)[0] == chain(2)
    with pytest.raises(UserError, match="depth=-1"):
        truncate(tree, -1)

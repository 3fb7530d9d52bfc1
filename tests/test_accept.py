"""The greedy acceptance rule and its statistics on crafted logits, then at decode time against a drafter built to
fool a lossy rule.

Every case pins one property a wrong rule would break: nothing after the first wrong draft on a path is accepted
(even a draft that matches), ties in the verifier's logits go to the lowest token id (as in plain greedy decoding),
padding in `retrieve` never matches, a fully accepted path emits the verifier's token after its leaf, and between
equally long paths the first row of `retrieve` (the lower-rank path) wins.
"""

from __future__ import annotations

import pytest
import torch

from eval.drafters.build import Draft, Drafter
from eval.engine.acceptance.greedy import greedy_accept
from eval.engine.acceptance.protocol import mean_accept_length, per_position_acceptance
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import Tree, chain, from_medusa_choices, tree_buffers
from helpers import varied_llama
from models.verifiers.core import Verifier

V = 16  # a small vocabulary is enough: the rule only compares token ids


def peaked(argmax: list[list[int]], vocab: int = V) -> torch.Tensor:
    """Logits (B, N, V) whose argmax at node i of row b is argmax[b][i] (one peak of 5 over a flat 0)."""
    logits = torch.zeros(len(argmax), len(argmax[0]), vocab)
    for b, row in enumerate(argmax):
        for i, token in enumerate(row):
            logits[b, i, token] = 5.0
    return logits


def accept(tree: Tree, tokens: list[list[int]], argmax: list[list[int]]):
    return greedy_accept(tree_buffers(tree).retrieve, torch.tensor(tokens), peaked(argmax))


def test_a_mismatch_stops_the_path_even_when_later_drafts_match():
    # chain(3): the verifier wants 5 after the root but the draft is 4; drafts 2 and 3 match the verifier's argmax
    # at their parents. A rule that counts matches past the first mismatch would accept 2.
    acc = accept(chain(3), tokens=[[9, 4, 6, 7]], argmax=[[5, 6, 7, 8]])
    assert acc.num_accepted.tolist() == [0]
    assert acc.last_node.tolist() == [0] and acc.next_token.tolist() == [5]  # the verifier's own token, not 4
    # The same in the middle of the path: one accepted, then a wrong draft, then a match.
    acc = accept(chain(3), tokens=[[9, 5, 1, 7]], argmax=[[5, 6, 7, 8]])
    assert acc.num_accepted.tolist() == [1] and acc.last_node.tolist() == [1] and acc.next_token.tolist() == [6]


def test_a_fully_accepted_path_emits_the_bonus_token():
    acc = accept(chain(3), tokens=[[9, 5, 6, 7]], argmax=[[5, 6, 7, 8]])
    assert acc.num_accepted.tolist() == [3] and acc.path.tolist() == [0]
    assert acc.last_node.tolist() == [3] and acc.next_token.tolist() == [8]  # the verifier's token after the leaf


def test_ties_in_the_verifier_logits_go_to_the_lowest_token_id():
    logits = torch.zeros(1, 3, V)
    logits[0, 0, [3, 11]] = 2.0  # the root's logits tie between tokens 3 and 11
    logits[0, 1, [4, 12]] = 2.0
    logits[0, 2, 0] = 1.0
    retrieve = tree_buffers(chain(2)).retrieve
    assert greedy_accept(retrieve, torch.tensor([[9, 11, 12]]), logits).num_accepted.tolist() == [0]
    acc = greedy_accept(retrieve, torch.tensor([[9, 3, 4]]), logits)
    assert acc.num_accepted.tolist() == [2] and acc.next_token.tolist() == [0]
    # The same tie-break as plain greedy decoding, so speculative output stays token for token greedy.
    assert logits[0, 0].argmax().item() == 3


def test_padding_in_retrieve_never_matches():
    # Nodes: 0 root, 1 = (0,), 2 = (1,), 3 = (0, 0). Rows: [0, 1, 3] and [0, 2, -1].
    tree = from_medusa_choices([(0,), (1,), (0, 0)])
    assert tree_buffers(tree).retrieve.tolist() == [[0, 1, 3], [0, 2, -1]]
    # Node 2 is right; the padded slot after it reads (clamped) the root, whose token 9 equals node 2's argmax,
    # so a rule that ignored padding would accept 2 drafts on the short row.
    acc = accept(tree, tokens=[[9, 1, 5, 2]], argmax=[[5, 0, 9, 0]])
    assert acc.num_accepted.tolist() == [1] and acc.path.tolist() == [1]
    assert acc.last_node.tolist() == [2] and acc.next_token.tolist() == [9]


def test_between_equally_long_paths_the_first_row_wins_and_a_longer_one_beats_it():
    # Nodes: 0 root, 1 = (0,), 2 = (1,), 3 = (0, 0), 4 = (1, 0). Rows: [0, 1, 3] and [0, 2, 4].
    tree = from_medusa_choices([(0,), (1,), (0, 0), (1, 0)])
    assert tree_buffers(tree).retrieve.tolist() == [[0, 1, 3], [0, 2, 4]]
    # Both depth-1 nodes carry the right token 5 (a drafter may repeat a token); both depth-2 nodes are wrong. The
    # verifier's next token differs under them (6 under node 1, 7 under node 2), so the winner shows in next_token.
    acc = accept(tree, tokens=[[9, 5, 5, 0, 0]], argmax=[[5, 6, 7, 1, 1]])
    assert acc.path.tolist() == [0] and acc.num_accepted.tolist() == [1]
    assert acc.last_node.tolist() == [1] and acc.next_token.tolist() == [6]
    # Nothing accepted anywhere: the first row, the root, and the root's argmax.
    acc = accept(tree, tokens=[[9, 3, 4, 0, 0]], argmax=[[5, 6, 7, 1, 1]])
    assert acc.path.tolist() == [0] and acc.last_node.tolist() == [0] and acc.next_token.tolist() == [5]
    # A longer accept on the second row beats the first; two batch rows are decided apart.
    acc = accept(tree, tokens=[[9, 5, 5, 0, 7], [9, 5, 5, 6, 0]], argmax=[[5, 6, 7, 1, 2], [5, 6, 7, 3, 1]])
    assert acc.path.tolist() == [1, 0] and acc.num_accepted.tolist() == [2, 2]
    assert acc.last_node.tolist() == [4, 3] and acc.next_token.tolist() == [2, 3]


def test_tau_and_alpha_from_accept_lengths():
    lengths = torch.tensor([[0], [2], [4], [1]])  # (R, B): drafts accepted per round
    assert mean_accept_length(lengths) == pytest.approx((1 + 3 + 5 + 2) / 4)
    assert per_position_acceptance(lengths, 5).tolist() == pytest.approx([0.75, 0.5, 0.25, 0.25, 0.0])
    assert mean_accept_length(torch.zeros(0, 1, dtype=torch.long)) == 0.0
    assert per_position_acceptance(torch.zeros(0, 1, dtype=torch.long), 3).tolist() == [0.0, 0.0, 0.0]
    # Two batch rows count as two rounds each.
    assert mean_accept_length(torch.tensor([[0, 3], [1, 2]])) == pytest.approx(2.5)
    assert per_position_acceptance(torch.tensor([[0, 3], [1, 2]]), 3).tolist() == pytest.approx([0.75, 0.5, 0.25])


class WrongFirstDrafter:
    """A drafter built to fool a rule that counts matches after the first mismatch: each round it drafts a wrong
    first token w (any token but the verifier's next one), then the verifier's own greedy continuation after w, so
    every later draft equals the verifier's argmax at its parent in the tree forward."""

    feature_layers = (-1,)

    def __init__(self, verifier: Verifier, tree: Tree) -> None:
        self.model, self.vocab = verifier.model, verifier.vocab_size
        self.tree, self.max_nodes, self.max_depth = tree, tree.num_nodes, tree.max_depth
        self.rounds = 0

    def describe(self) -> dict:
        return {"policy": "wrong-first"}

    @torch.no_grad()
    def propose(self, input_ids, hidden) -> Draft:
        tree = self.tree
        assert tree == chain(tree.num_drafts)
        right = int(self.model(input_ids).logits[0, -1].argmax())  # what the verifier says after the root
        seq = torch.cat([input_ids, torch.tensor([[(right + 1) % self.vocab]])], dim=1)
        for _ in range(tree.num_drafts - 1):  # the verifier's greedy continuation of the wrong prefix
            seq = torch.cat([seq, self.model(seq).logits[:, -1:].argmax(-1)], dim=1)
        self.rounds += 1
        return Draft(tree=tree, tokens=seq[:, input_ids.shape[1] - 1 :])

    def accepted(self, num_accepted, nodes) -> None:
        pass


@pytest.mark.usefixtures("one_thread")
def test_drafts_after_a_wrong_first_token_are_never_accepted():
    verifier = varied_llama()
    ids = verifier.tokenizer("The capital of France is Paris. The capital of", return_tensors="pt").input_ids
    ref = greedy_decode(verifier, ids, 20).tokens[0].tolist()
    assert len(set(ref)) > 5  # a verifier whose output varies, so that a wrong cache or path shows in the tokens
    drafter = WrongFirstDrafter(verifier, chain(4))
    assert isinstance(drafter, Drafter)
    result = speculative_decode(verifier, drafter, ids, 20)
    assert result.tokens[0].tolist() == ref
    assert drafter.rounds == 19 and result.accept_lengths.tolist() == [[0]] * 19 and result.tau == 1.0

"""Greedy speculative decoding is exact: token for token our plain greedy and Hugging Face `generate`, for chains
and trees, with bad drafts and with good ones, on two tiny verifiers (Llama and Qwen3, fp32).

The tiny random verifiers get large random layer weights so that their continuations depend on the whole context
(`build_tiny` as is repeats one token forever, which would hide a wrong cache). The good drafter is an oracle that
knows the verifier's continuation and hides each right token at a random rank, so accepted paths run through every
branch of a tree and the KV commit has to gather scattered nodes; the negative controls break the commit and the
mask and must change the output.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from eval.drafters.build import Draft, Drafter, make_drafter
from eval.drafters.medusa import MedusaDrafter
from eval.engine import decode, session
from eval.engine import hf_forward as kv
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import AutoTree, Tree, TreeBuffers, auto_tree, chain, from_medusa_choices
from helpers import varied_llama
from models.exports.io import save_export
from models.medusa import MedusaHeads
from models.verifiers.core import Verifier, fingerprint, freeze
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError

PROMPTS = ["Hello, my name is", "def fib(n):\n    return", "The capital of France is Paris. The capital of"]
MAX_NEW = 40
SPARSE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)]
ACCURACY = [[0.6, 0.75, 0.8, 0.83], [0.45, 0.55, 0.6, 0.62], [0.35, 0.42, 0.46, 0.5], [0.25, 0.3, 0.33, 0.35]]
TREES = {"chain": chain(4), "sparse": from_medusa_choices(SPARSE), "auto": auto_tree(ACCURACY, 12)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base():
    return build_tiny(cache_dir=os.environ.get("SPECDRAFT_CACHE"), dtype="float32", device="cpu")


def _varied_llama(base: Verifier) -> Verifier:
    return varied_llama()


def _tiny_qwen3(base: Verifier) -> Verifier:
    tok = base.tokenizer
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, initializer_range=0.2,
        max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = freeze(Qwen3ForCausalLM(config))
    return Verifier(model, tok, {"loader": "hf", "path": "tiny-qwen3"}, "tiny-qwen3", fingerprint(model))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def verifier(request, base):
    return {"llama": _varied_llama, "qwen3": _tiny_qwen3}[request.param](base)


def _hf_generate(verifier: Verifier, ids: torch.Tensor, max_new: int, eos: int) -> list[int]:
    out = verifier.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
        pad_token_id=eos,
    )
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(verifier):
    """Per prompt: (input_ids, HF greedy continuation of MAX_NEW + 8 tokens, so the oracle can draft past the end)."""
    eos = verifier.tokenizer.eos_token_id
    refs = []
    for prompt in PROMPTS:
        ids = verifier.tokenizer(prompt, return_tensors="pt").input_ids
        ref = _hf_generate(verifier, ids, MAX_NEW + 8, eos)
        assert len(ref) == MAX_NEW + 8 and eos not in ref  # no early EOS: the EOS test picks its own
        refs.append((ids, ref))
    return refs


class OracleDrafter:
    """A test drafter that knows the verifier's greedy continuation. Per depth it puts the right token under the
    right parent, at rank 0 or a random rank, or leaves it out with probability `miss`; every other node gets a
    random token."""

    feature_layers = (-1,)

    def __init__(self, verifier: Verifier, prompt_len: int, reference: list[int], tree: Tree, miss: float = 0.2,
                 seed: int = 0, last_child: bool = False):
        self.tree, self.max_nodes, self.max_depth = tree, tree.num_nodes, tree.max_depth
        self.lm_head, self.vocab = verifier.lm_head, verifier.vocab_size
        self.prompt_len, self.reference, self.miss = prompt_len, reference, miss
        self.rng = random.Random(seed)
        self.last_child = last_child  # always the last child, not mostly the first
        self.scattered = False  # did an accepted path skip over tree nodes (a real gather in the commit)?

    def describe(self) -> dict:
        return {"policy": "oracle"}

    def propose(self, input_ids, hidden) -> Draft:
        tree = self.tree
        root = input_ids[0, -1].item()
        # The loop must hand over the verifier's outputs at the token before the root: those chose the root.
        assert self.lm_head(hidden[:, -1]).argmax(-1).item() == root
        truth = self.reference[input_ids.shape[1] - self.prompt_len :]  # what the verifier says after the root
        tokens = [root] + [self.rng.randrange(self.vocab) for _ in range(tree.num_nodes - 1)]
        node = 0
        for depth in range(1, min(tree.max_depth, len(truth)) + 1):
            children = [i for i, p in enumerate(tree.parents) if p == node]
            if not children or self.rng.random() < self.miss:
                break
            # Mostly the first child, as a real drafter's best guess; sometimes any, so paths run through every branch.
            node = children[0] if self.rng.random() < 0.5 else self.rng.choice(children)
            node = children[-1] if self.last_child else node
            tokens[node] = truth[depth - 1]
        self.proposed = (tokens, truth)
        return Draft(tree=tree, tokens=torch.tensor([tokens]))

    def accepted(self, num_accepted, nodes) -> None:
        # `nodes` index this drafter's own tree (even when the loop verified a truncated one): the accepted drafts.
        tokens, truth = self.proposed
        assert [tokens[i] for i in nodes[0, 1:].tolist()] == truth[: int(num_accepted[0])]
        self.scattered |= not torch.equal(nodes[0], torch.arange(nodes.shape[1]))


def _bad_medusa(verifier: Verifier, tree: Tree, seed: int = 0) -> MedusaDrafter:
    heads = MedusaHeads(verifier.hidden_size, verifier.vocab_size, num_heads=4, num_layers=1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)  # far from the verifier's head: drafts mostly wrong
    return make_drafter("medusa", verifier, tree, net=heads)


def test_plain_greedy_matches_hf_generate(verifier, references):
    for ids, ref in references:
        result = greedy_decode(verifier, ids, MAX_NEW, verifier.tokenizer.eos_token_id)
        assert result.tokens[0].tolist() == ref[:MAX_NEW]
        assert result.num_forwards == MAX_NEW and result.tau == 1.0


@pytest.mark.parametrize("tree_name", list(TREES))
def test_bad_medusa_drafts_still_give_exact_output(verifier, references, tree_name):
    drafter = _bad_medusa(verifier, TREES[tree_name])
    assert isinstance(drafter, Drafter)
    for ids, ref in references:
        result = speculative_decode(verifier, drafter, ids, MAX_NEW, verifier.tokenizer.eos_token_id)
        assert result.tokens[0].tolist() == ref[:MAX_NEW]
        assert result.num_forwards == 1 + len(result.accept_lengths)
        assert 1.0 <= result.tau < 1.5  # mostly rejected


@pytest.mark.parametrize("tree_name", list(TREES))
def test_good_drafts_are_accepted_and_output_stays_exact(verifier, references, tree_name):
    taus, scattered = [], False
    for seed, (ids, ref) in enumerate(references):
        drafter = OracleDrafter(verifier, ids.shape[1], ref, TREES[tree_name], seed=seed)
        assert isinstance(drafter, Drafter)
        result = speculative_decode(verifier, drafter, ids, MAX_NEW, verifier.tokenizer.eos_token_id)
        assert result.tokens[0].tolist() == ref[:MAX_NEW]
        assert result.num_forwards <= 3 * MAX_NEW // 4
        emitted = 1 + int((result.accept_lengths + 1).sum())  # prefill token + per round accepted + bonus
        assert emitted == MAX_NEW  # the rounds count only the tokens that were kept
        assert result.alpha.shape == (4,) and result.alpha[0] >= result.alpha[-1]
        taus.append(result.tau)
        scattered |= drafter.scattered
    assert min(taus) > 1.5 and sum(taus) / len(taus) > 2.0, taus
    assert scattered == (tree_name != "chain")  # trees must have accepted paths off their first nodes


def test_eos_stops_right_after_it(verifier, references):
    ids, ref = references[0]
    eos = ref[15]
    cut = ref[: ref.index(eos) + 1]
    assert _hf_generate(verifier, ids, MAX_NEW, eos) == cut
    assert greedy_decode(verifier, ids, MAX_NEW, eos).tokens[0].tolist() == cut
    for tree in TREES.values():
        oracle = OracleDrafter(verifier, ids.shape[1], ref, tree)
        assert speculative_decode(verifier, oracle, ids, MAX_NEW, eos).tokens[0].tolist() == cut
        medusa = _bad_medusa(verifier, tree)
        assert speculative_decode(verifier, medusa, ids, MAX_NEW, [eos, 0]).tokens[0].tolist() == cut


@pytest.mark.parametrize("max_new", [0, 1, 2, 3, 7, 11])
def test_max_new_tokens_is_cut_exactly(base, max_new):
    verifier = _varied_llama(base)
    ids = verifier.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    ref = greedy_decode(verifier, ids, 20).tokens[0].tolist()
    # A tree that lists a depth-1 node (3) after a depth-2 one, drafted right through node 3: cut to depth 1 (the
    # last round of max_new 3), it is renumbered, and the drafter must still be told node 3.
    late = Tree(parents=(-1, 0, 1, 0, 3, 3), ranks=(-1, 0, 0, 1, 0, 1))
    for tree in (TREES["sparse"], late, chain(4)):
        oracle = OracleDrafter(verifier, ids.shape[1], ref, tree, miss=0.0, last_child=tree == late)
        result = speculative_decode(verifier, oracle, ids, max_new)
        assert result.tokens[0].tolist() == ref[:max_new]
    # A chain always right: the prefill gives 1 token, each round 5; no forward once max_new is reached.
    assert result.num_forwards == (0 if max_new == 0 else 1 + -(-(max_new - 1) // 5))


@pytest.mark.parametrize("max_new, sizes", [(1, []), (2, [1]), (3, [2]), (7, [5, 1]), (8, [5, 2]), (11, [5, 5])])
def test_tau_counts_what_is_kept_and_the_last_round_stops_at_the_budget(base, max_new, sizes):
    # A perfect chain of 4: the drafter proposes the verifier's own greedy continuation. The prefill emits the first
    # token; each round then needs at most the remaining budget, so its tree is cut to depth remaining - 1 before
    # the verifier forward, and tau counts what the output keeps (max_new 2: one round of one token, tau 1, not 5).
    verifier = _varied_llama(base)
    ids = verifier.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    ref = greedy_decode(verifier, ids, 20).tokens[0].tolist()
    seen = []  # tokens in each verifier forward, the prefill first
    hook = verifier.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        oracle = OracleDrafter(verifier, ids.shape[1], ref, chain(4), miss=0.0)
        result = speculative_decode(verifier, oracle, ids, max_new)
    finally:
        hook.remove()
    assert result.tokens[0].tolist() == ref[:max_new]
    assert seen == [ids.shape[1]] + sizes
    assert result.accept_lengths[:, 0].tolist() == [n - 1 for n in sizes]
    assert result.tau == (sum(sizes) / len(sizes) if sizes else 0.0)
    # The EOS cut: the verifier's 8th token is made an EOS, the second draft of the second round.
    if max_new == 11:
        assert ref[7] not in ref[:7]
        result = speculative_decode(verifier, OracleDrafter(verifier, ids.shape[1], ref, chain(4), miss=0.0), ids,
                                    max_new, eos_token_id=ref[7])
        assert result.tokens[0].tolist() == ref[:8]
        assert result.accept_lengths[:, 0].tolist() == [4, 1] and result.tau == 3.5  # 5 + 2 kept, not 5 + 5


def test_medusa_heads_that_draft_well_on_a_repeating_verifier(base):
    # Fresh Medusa heads are the verifier's own head (zero-initialised blocks); the plain tiny verifier repeats its
    # token, so every draft is right and each round emits depth + 1 tokens.
    heads = MedusaHeads(base.hidden_size, base.vocab_size, num_heads=4)
    drafter = make_drafter("medusa", base, chain(4), net=heads)
    ids = base.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    ref = _hf_generate(base, ids, MAX_NEW, base.tokenizer.eos_token_id)
    result = speculative_decode(base, drafter, ids, MAX_NEW, base.tokenizer.eos_token_id)
    assert result.tokens[0].tolist() == ref
    # The prefill's token, 7 rounds of 5, and a last round cut to the 4 tokens left (3 drafts + the bonus).
    assert result.accept_lengths[:, 0].tolist() == [4] * 7 + [3] and result.num_forwards == 1 + 8
    assert result.tau == pytest.approx(39 / 8) and result.alpha.tolist() == pytest.approx([1.0, 1.0, 1.0, 7 / 8])
    assert set(result.times) >= {"prefill_s", "verify_s", "draft_s", "commit_s", "total_s"}


def test_factory_loads_an_export_and_its_accuracy(base, tmp_path):
    heads = MedusaHeads(base.hidden_size, base.vocab_size, num_heads=3)
    save_export(heads, base, tmp_path / "export", {"medusa_topk_accuracy": ACCURACY[:3]})
    drafter = make_drafter("medusa", base, AutoTree(6), checkpoint=tmp_path / "export")
    assert drafter.tree == auto_tree(ACCURACY[:3], 6)  # grown from the export's own accuracy table
    ids = base.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    hidden = base.hidden_states(ids)
    draft = drafter.propose(ids, hidden)
    assert draft.tokens.shape == (1, 7)
    with pytest.raises(UserError, match="3 heads"):
        make_drafter("medusa", base, chain(4), checkpoint=tmp_path / "export")
    with pytest.raises(UserError, match="no family with an export"):
        make_drafter("lookahead", base, chain(4), net=heads)


# Negative controls: the tests above must notice a wrong commit or a wrong mask.


def test_negative_control_wrong_commit_changes_the_output(verifier, references, monkeypatch):
    def first_nodes(cache, prefix_len, keep):  # keeps as many entries as accepted, but the wrong ones
        kv_commit(cache, prefix_len, torch.arange(keep.shape[1])[None])

    kv_commit = kv.commit
    monkeypatch.setattr(session.kv, "commit", first_nodes)
    ids, ref = references[0]
    result = speculative_decode(verifier, OracleDrafter(verifier, ids.shape[1], ref, TREES["sparse"]), ids, MAX_NEW)
    assert result.tokens[0].tolist() != ref[:MAX_NEW]


def test_negative_control_causal_mask_changes_the_output(verifier, references, monkeypatch):
    def causal_buffers(tree, device=None):  # a chain's mask on a tree: siblings see each other
        buf = tree_buffers(tree, device)
        return TreeBuffers(mask=torch.ones_like(buf.mask).tril(), positions=buf.positions, retrieve=buf.retrieve)

    tree_buffers = decode.tree_buffers
    monkeypatch.setattr(decode, "tree_buffers", causal_buffers)
    ids, ref = references[0]
    result = speculative_decode(verifier, OracleDrafter(verifier, ids.shape[1], ref, TREES["sparse"]), ids, MAX_NEW)
    assert result.tokens[0].tolist() != ref[:MAX_NEW]


# Medusa heads of distinct, known behaviour: head k (0-based) drafts at depth k+1, and each node takes its rank.


def _constant_heads(verifier: Verifier, targets: list[list[int]], share: bool) -> tuple[MedusaHeads, list[list[int]]]:
    """Heads whose ranked candidates do not depend on the context: head k adds 1e4 along hidden dimension 2k + 1,
    which outweighs the normed hidden state. Unshared, head k's projection reads that dimension for targets[k]
    (rank 0 weight 1, rank 1 weight 0.5, the rest 0); shared, the verifier's own head ranks tokens by their embedding
    on that dimension. Returns the heads and, per head, its expected top-2."""
    k_heads = len(targets)
    heads = MedusaHeads(verifier.hidden_size, verifier.vocab_size, num_heads=k_heads, share_lm_head=share)
    expected = []
    with torch.no_grad():
        for k in range(k_heads):
            dim = 2 * k + 1
            heads.blocks[k].layers[0].bias[dim] = 1e4  # x + SiLU(0 * x + b) = x + 1e4 e_dim
            if share:
                expected.append(verifier.lm_head.weight[:, dim].topk(2).indices.tolist())
            else:
                weight = heads.lm_heads[k].weight
                weight.zero_()
                weight[targets[k][0], dim], weight[targets[k][1], dim] = 1.0, 0.5
                expected.append(list(targets[k]))
    return heads, expected


@pytest.mark.parametrize("share", [True, False], ids=["shared_head", "own_heads"])
def test_medusa_heads_draft_at_their_own_depth_and_rank(base, share):
    verifier = _varied_llama(base)
    ids = verifier.tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    ref = greedy_decode(verifier, ids, 24).tokens[0].tolist()
    # Unshared heads draft the verifier's own continuation after the first root at rank 0 (a decoy at rank 1), so
    # the first round accepts every draft only if head k drafts depth k+1.
    decoys = [ref[10 + k] for k in range(4)]
    heads, top2 = _constant_heads(verifier, [[ref[1 + k], decoys[k]] for k in range(4)], share)
    assert len({t[0] for t in top2}) == 4 and all(a != b for a, b in top2)  # four heads, four different tokens
    tree = from_medusa_choices(SPARSE)  # ranks 0 and 1 at depths 1..3
    drafter = make_drafter("medusa", verifier, tree, net=heads)
    hidden = verifier.hidden_states(ids)
    draft = drafter.propose(torch.cat([ids, torch.tensor([[ref[0]]])], dim=1), hidden)
    expected = [ref[0]] + [top2[d - 1][r] for d, r in zip(tree.depths[1:], tree.ranks[1:])]
    assert draft.tokens[0].tolist() == expected
    result = speculative_decode(verifier, make_drafter("medusa", verifier, chain(4), net=heads), ids, 24)
    assert result.tokens[0].tolist() == ref
    if not share:
        assert result.accept_lengths[0, 0].item() == 4

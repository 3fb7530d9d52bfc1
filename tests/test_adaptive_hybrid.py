"""The hybrid's split chosen per round (eval/drafters/hybrid.py under a planned primary, eval/planner/adaptive.py):
lookup chains and the drafter's nodes verified as what each has been accepting on the prompt says they are worth. On
tiny
real verifiers: the output stays plain greedy's, a prompt whose answer lookup predicts verifies its chains beyond
the drafter's own budget and drops the drafter's worthless nodes, each round's prediction tracks what each part of
the tree brings (lookup's chain per depth; a node both parts propose counted once), and a hybrid with no lookup
source is refused."""

from __future__ import annotations

import pytest
import torch
from test_adaptive import OPTIMISTIC, PROMPTS, base, planned_medusa, random_heads, run_eval  # noqa: F401

from eval.drafters.hybrid import LOOKUP_STRENGTH, HybridDrafter, LookupDepths, split
from eval.drafters.lookup import PromptLookupDrafter
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import Chain
from eval.planner import cost
from models.medusa import MedusaHeads
from models.verifiers.core import Verifier
from runtime.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 48


def test_lookup_that_predicts_the_answer_takes_the_round(base: Verifier):  # noqa: F811
    # The tiny verifier repeats itself, so lookup's chains are right; random heads draft nothing it accepts.
    primary = planned_medusa(base, random_heads(base), OPTIMISTIC, adaptive=True)
    hybrid = HybridDrafter(primary, PromptLookupDrafter(Chain(10), 10))
    taus = []
    for text in PROMPTS * 3:  # the export's table is worth RUN_PRIOR rounds a cell: the run takes a few to refute it
        ids = base.tokenizer(text, return_tensors="pt").input_ids
        got = speculative_decode(base, hybrid, ids, MAX_NEW)
        assert got.tokens[0].tolist() == greedy_decode(base, ids, MAX_NEW).tokens[0].tolist()
        taus.append(got.tau)
        p = hybrid.prediction()
        assert p is not None and p.rounds == len(got.accept_lengths)
    k, m = hybrid.last_split
    assert hybrid.lookup.rate(0) > 0.8 and k >= 5  # the chain verified, the drafter's nodes beside it only as they pay
    assert m < k and taus[-1] > 4.0


def repeat_prompts(verifier: Verifier, lead: int) -> list[torch.Tensor]:
    """Three prompts for the tiny verifier, which repeats a prompt's last token X for ever: each starts with `lead`
    X's and junk, so lookup's earliest match of the last three tokens (X X X) is at the prompt's start, and its chain
    is the X's left after the match, then the junk."""
    tail = verifier.tokenizer(PROMPTS[1], return_tensors="pt").input_ids[0].tolist()
    x = tail[-1]
    prompts = []
    for p in range(3):
        junk = [(x + 101 * (p * 5 + i + 1)) % verifier.vocab_size for i in range(5)]
        ids = torch.tensor([[x] * lead + junk + tail])
        assert set(greedy_decode(verifier, ids, 8).tokens[0].tolist()) == {x}  # the premise: X for ever
        prompts.append(ids)
    return prompts


def shallow_prompts(verifier: Verifier) -> list[torch.Tensor]:
    """Prompts whose lookup chains are right for two tokens and wrong at the third, every round (X X X X X and
    junk: the chain is X X junk)."""
    return repeat_prompts(verifier, 5)


def decode_shallow(verifier: Verifier, hybrid: HybridDrafter) -> tuple[int, float, float]:
    """(rounds, predicted E[tokens] per round, measured) over the shallow prompts, each exactly plain greedy."""
    rounds = predicted = tokens = 0.0
    for ids in shallow_prompts(verifier):
        got = speculative_decode(verifier, hybrid, ids, 64)
        assert got.tokens[0].tolist() == greedy_decode(verifier, ids, 64).tokens[0].tolist()
        p = hybrid.prediction()
        assert p is not None and p.rounds == len(got.accept_lengths)
        rounds, predicted = rounds + p.rounds, predicted + p.tokens
        tokens += float(got.accept_lengths.sum()) + len(got.accept_lengths)
    return int(rounds), predicted / rounds, tokens / rounds


def test_lookup_that_matches_shallowly_is_predicted_per_depth(base: Verifier):  # noqa: F811
    # Chains of 3 (drafter.num_tokens=3), right at depths 1 and 2 and wrong at 3; the drafter (random heads) is never
    # right, so the rounds' tokens are lookup's. One rate a for all depths (a^i) would say a = 2/3 and 1.41 tokens.
    primary = planned_medusa(base, random_heads(base), OPTIMISTIC, adaptive=True)
    hybrid = HybridDrafter(primary, PromptLookupDrafter(Chain(3), 3))
    rounds, predicted, measured = decode_shallow(base, hybrid)
    predicted_lookup, got_lookup = (x / rounds for x in hybrid.tally["lookup"])
    assert got_lookup > 1.8  # the premise: two of three, nearly every round
    # What the per-depth estimate may still be off by: its priors, LOOKUP_STRENGTH observations a depth, spread over
    # the run's rounds (3 depths, 64 tokens on each of 3 prompts: about 50 rounds, 0.25 tokens a round).
    tolerance = 3 * LOOKUP_STRENGTH / rounds
    assert abs(predicted_lookup - got_lookup) < tolerance
    assert abs(predicted - measured) < tolerance + 0.1  # the drafter's part: 0.0 got, what its prior still gives
    assert hybrid.lookup.rate(1, size=3) > 0.8 and hybrid.lookup.rate(2, size=3) < 0.2  # X X X: a 3-gram match


def test_a_node_both_parts_propose_is_counted_once(base: Verifier):  # noqa: F811
    # The drafter is the verifier's own head (zero blocks: always right), planned on a table that says so; lookup's
    # chain X X junk shares its first two nodes with the drafter's chain X X X X. Counted twice, the shared nodes
    # would promise about 1.5 tokens a round more than come.
    heads = MedusaHeads(base.hidden_size, base.vocab_size, num_heads=4)
    primary = planned_medusa(base, heads, [[0.95, 0.97, 0.98, 0.99]] * 4, adaptive=True)
    hybrid = HybridDrafter(primary, PromptLookupDrafter(Chain(3), 3))
    rounds, predicted, measured = decode_shallow(base, hybrid)
    tolerance = (3 + 4) * LOOKUP_STRENGTH / rounds  # the priors of lookup's 3 depths and the drafter's 4
    assert measured > 4.0 and abs(predicted - measured) < tolerance
    predicted_drafter, got_drafter = (x / rounds for x in hybrid.tally["drafter"])
    assert predicted_drafter < got_drafter + tolerance / 2


def test_the_split_follows_the_values():
    ms = lambda n: 10.0 + 0.5 * n  # noqa: E731
    drafter = [0.6, 0.3, 0.2, 0.1, 0.05]
    assert split([0.9 ** (i + 1) for i in range(8)], drafter, 63, ms)[0] == 8  # good lookup: all of its chain
    assert split([0.05 ** (i + 1) for i in range(8)], drafter, 63, ms)[0] == 0  # poor lookup: none of it
    k, m = split([0.7 ** (i + 1) for i in range(8)], drafter, 4)  # a fixed budget of 4: the 4 best of both
    assert (k, m) == (3, 1)  # 0.7, 0.6, 0.49, 0.343
    rate = LookupDepths()
    for _ in range(20):
        rate.observe(0, False, False)  # offered at depth 0, never right
        rate.observe(1, False, True)  # ... and always right below (another prompt's chains)
    assert rate.rate(0) < 0.1 and rate.rate(1) > 0.8
    rate.new_prompt()  # the prompt starts from the run's rates
    assert rate.rate(0, shared=True) == 0.5  # nodes the drafter proposed too are counted apart
    assert rate.rate(0) < 0.15 and rate.rate(2) > 0.7  # a depth never reached starts from the one above


def test_a_hybrid_with_no_lookup_source_is_refused(base, tmp_path, tmp_path_factory):  # noqa: F811
    from models.exports.io import save_export

    export = save_export(random_heads(base), base, tmp_path_factory.mktemp("e") / "medusa",
                         {"medusa_topk_accuracy": OPTIMISTIC})
    for bad in ("drafter.num_tokens=0", "drafter.budget=1"):
        with pytest.raises(UserError, match=f"{bad} leaves no lookup source usable"):
            run_eval([f"checkpoint={export}", "drafter=hybrid", bad], tmp_path)
    report = run_eval([f"checkpoint={export}", "drafter=hybrid", "num_prompts=2"], tmp_path)
    assert report["method"].startswith("hybrid/hybrid-") and report["greedy_match"] == 1.0
    assert report["predicted_speedup"] is not None and report["tree"]["split"] == "per round"
    assert cost.PROBE_SIZE + 1 == report["tree"]["primary"]["max_nodes"]


def planned_eagle(verifier: Verifier, draft_ms: float):
    """A planned EAGLE-1 with random weights (its drafts nearly never accepted) whose drafting costs `draft_ms` a
    round on the test curve, priced as the curve says (not re-timed)."""
    from test_adaptive import curve
    from test_eagle_decode import random_net

    from eval.drafters.build import make_drafter
    from eval.engine.tree import AutoTree
    from eval.planner.adaptive import PlannedDrafter

    table = [[0.3, 0.4, 0.45, 0.5]] * 4
    draft = [draft_ms] * len(cost.SIZES)
    size = cost.best_size(curve().sizes, curve().ms, table, draft=draft).size
    inner = make_drafter("eagle", verifier, AutoTree(size=cost.PROBE_SIZE), net=random_net("eagle", verifier))
    return PlannedDrafter(inner, table, "dynamic", curve(), draft, size, True, learn_times=False)


def test_a_round_lookup_wins_alone_runs_no_drafter_forward(base: Verifier):  # noqa: F811
    """Lookup's chains are right (the tiny verifier repeats itself), the drafter's nodes are not, and drafting costs
    half a verify: most rounds verify lookup's chain alone, with no drafter forward, and the drafter catches up on
    the positions it sat out (its cache fed every committed position: EAGLE refuses a round out of step). Shallow
    chains (right for two tokens) bring the drafter back between such rounds. Output: plain greedy's."""
    for prompts, num_tokens in ((PROMPTS, 10), (None, 3)):
        hybrid = HybridDrafter(planned_eagle(base, 5.0), PromptLookupDrafter(Chain(num_tokens), num_tokens),
                               sit_out=True)
        rounds = 0
        for ids in ([base.tokenizer(t, return_tensors="pt").input_ids for t in prompts] if prompts
                    else shallow_prompts(base)):
            got = speculative_decode(base, hybrid, ids, MAX_NEW)
            assert got.tokens[0].tolist() == greedy_decode(base, ids, MAX_NEW).tokens[0].tolist()
            p = hybrid.prediction()
            assert p is not None and p.rounds == len(got.accept_lengths)
            rounds += p.rounds
        assert 0 < hybrid.lookup_rounds, num_tokens
        if prompts:
            assert hybrid.lookup_rounds > rounds // 2
    ids = base.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    free = HybridDrafter(planned_eagle(base, 0.0), PromptLookupDrafter(Chain(10), 10), sit_out=True)
    speculative_decode(base, free, ids, MAX_NEW)
    assert free.lookup_rounds == 0  # drafting free: it always runs
    off = HybridDrafter(planned_eagle(base, 5.0), PromptLookupDrafter(Chain(10), 10))  # the default: never sits out
    speculative_decode(base, off, ids, MAX_NEW)
    assert off.lookup_rounds == 0


class EveryOtherRound(HybridDrafter):
    """A hybrid that sits its drafter out every other round lookup has a chain: the drafter catches up on one to
    several rounds' positions again and again."""

    turn = 0

    def _lookup_alone(self, extra):
        wins = super()._lookup_alone(extra)  # sets the chain length such a round verifies
        self.turn += 1
        return extra.tree.num_drafts > 0 and (self.turn % 3 != 0 or wins)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_drafter_catches_up_on_the_rounds_it_sat_out(base: Verifier, kind):  # noqa: F811
    """After rounds of lookup alone, the drafter is handed every position committed meanwhile and drafts on from
    there (EAGLE refuses a round out of step with its cache); output stays plain greedy's."""
    from test_adaptive import curve
    from test_eagle_decode import random_net

    from eval.drafters.build import make_drafter
    from eval.engine.tree import AutoTree
    from eval.planner.adaptive import PlannedDrafter

    table = [[0.3, 0.4, 0.45, 0.5]] * 4
    inner = make_drafter(kind, base, AutoTree(size=cost.PROBE_SIZE), net=random_net(kind, base))
    primary = PlannedDrafter(inner, table, "dynamic", curve(), None, 4, True)
    hybrid = EveryOtherRound(primary, PromptLookupDrafter(Chain(3), 3), sit_out=True)
    for ids in shallow_prompts(base):
        got = speculative_decode(base, hybrid, ids, MAX_NEW)
        assert got.tokens[0].tolist() == greedy_decode(base, ids, MAX_NEW).tokens[0].tolist()
    assert 0 < hybrid.lookup_rounds


class Recording(HybridDrafter):
    """A hybrid that records, per round, lookup's predicted part and the chain nodes it verified."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[float, int]] = []

    def _planned_round(self, drafted, extra, start):
        draft = super()._planned_round(drafted, extra, start)
        self.rounds.append((self._part[0], self.last_split[0]))
        return draft


def missing_prompts(verifier: Verifier) -> list[torch.Tensor]:
    """Prompts whose lookup chains miss at their first node every round (X X X and junk: the 3-gram match finds the
    prompt's start, and its chain is the junk)."""
    return repeat_prompts(verifier, 3)


def after_good_chains(verifier: Verifier, ms_per_node: float) -> Recording:
    """A hybrid (random heads, so the rounds' tokens are lookup's) that has decoded prompts whose 3-gram chains were
    right, then the missing prompts, on a verifier costing 10 ms + `ms_per_node` a node."""
    sizes = list(cost.SIZES)
    steep = cost.Curve("float32", 1, "hf", sizes, [10.0 + ms_per_node * n for n in sizes], [0.0] * len(sizes),
                       [0.0] * len(sizes), {})
    from eval.drafters.build import make_drafter
    from eval.engine.tree import auto_tree
    from eval.planner.adaptive import PlannedDrafter

    inner = make_drafter("medusa", verifier, auto_tree(OPTIMISTIC, cost.PROBE_SIZE), net=random_heads(verifier))
    size = cost.best_size(steep.sizes, steep.ms, OPTIMISTIC).size
    hybrid = Recording(PlannedDrafter(inner, OPTIMISTIC, "fixed", steep, None, size, True),
                       PromptLookupDrafter(Chain(10), 10))
    for text in PROMPTS * 2:  # the run learns that 3-gram chains are right
        ids = verifier.tokenizer(text, return_tensors="pt").input_ids
        speculative_decode(verifier, hybrid, ids, MAX_NEW)
        hybrid.prediction()
    assert hybrid.lookup.rate(0, size=3) > 0.3  # the premise: the run prices 3-gram chains well
    hybrid.rounds = []
    hybrid.per_prompt = []  # type: ignore[attr-defined]
    hybrid.tally_before = hybrid.tally["lookup"][1]  # type: ignore[attr-defined]
    for ids in missing_prompts(verifier):
        got = speculative_decode(verifier, hybrid, ids, 64)
        assert got.tokens[0].tolist() == greedy_decode(verifier, ids, 64).tokens[0].tolist()
        p = hybrid.prediction()
        assert p is not None and p.rounds == len(hybrid.rounds)
        hybrid.per_prompt.append(hybrid.rounds)  # type: ignore[attr-defined]
        hybrid.rounds = []
    return hybrid


def test_a_prompt_whose_chains_keep_missing_is_predicted_as_the_drafter_alone(base: Verifier):  # noqa: F811
    # The run's 3-gram chains were right; this prompt's miss every round. Its own counts price them down within a
    # few rounds (the run's, 50-odd good chains, would take the whole decode): lookup's part of the round's
    # prediction falls to nothing, and the round is predicted as the drafter's nodes alone. A prompt estimate as
    # heavy as the run's kept promising about a token a round from lookup (nothing came).
    hybrid = after_good_chains(base, 0.1)
    for rounds in hybrid.per_prompt:
        late = rounds[len(rounds) // 2:]
        assert sum(part for part, _ in late) / len(late) < 0.2  # what is left: the prompt prior's, 2 / rounds
    got = hybrid.tally["lookup"][1] - hybrid.tally_before  # type: ignore[attr-defined]
    assert got <= len(hybrid.per_prompt)  # the premise: at most a token from lookup a prompt (its first round)


def test_the_split_stops_grafting_chains_that_keep_missing(base: Verifier):  # noqa: F811
    # A node costs a tenth of a forward: once the prompt's chains have missed a few times, none is worth its node.
    hybrid = after_good_chains(base, 1.0)
    for rounds in hybrid.per_prompt:
        assert rounds[0][1] > 0  # the first rounds try the chain (the run's estimate: 3-gram chains are right)
        late = rounds[len(rounds) // 4:]
        assert sum(k for _, k in late) / len(late) < 0.2


def test_a_prompts_own_outcomes_move_every_depth_and_size():
    # The run so far: chains right half the time at every depth and match size. This prompt's first four chains (1-gram
    # matches) miss at their first node: its 3-gram chains, never offered on it, and their deeper nodes are priced down
    # too (the prompt's outcomes pooled over every depth, kind and size), and a prompt whose chains land is priced up.
    def after(hit: bool) -> list[float]:
        rates = LookupDepths()
        for i in range(40):
            for size in (1, 2, 3):
                for depth in range(3):
                    rates.observe(depth, False, i % 2 == 0, size)
        rates.new_prompt()
        run = rates.values([False] * 3, size=3)
        for _ in range(4):
            rates.observe(0, False, hit, size=1)
        assert all(abs(v - 0.5 ** (d + 1)) < 0.02 for d, v in enumerate(run))
        return [v / r for v, r in zip(rates.values([False] * 3, size=3), run)]

    missed, landed = after(False), after(True)
    assert missed[0] < 0.75 and missed[2] < 0.4  # 0.5 -> 0.33 a depth: hits (4 + 0) / (4 + 2 expected)
    assert landed[0] > 1.2 and landed[2] > 1.8  # 0.5 -> 0.67: misses (4 + 0) / (4 + 2 expected)


def test_lookup_chains_are_priced_by_their_match_size():
    # Recorded outcomes, one prompt: chains from 3-gram matches right at every depth, from 1-gram matches wrong at
    # their first node. Pooled, both would be priced at about the same middling rate.
    rates = LookupDepths()
    for _ in range(20):
        for depth in range(3):
            rates.observe(depth, False, True, size=3)
        rates.observe(0, False, False, size=1)
    assert rates.rate(0, size=3) > 0.8 and rates.rate(0, size=1) < 0.2
    assert rates.values([False] * 3, size=3)[-1] > 0.7 and rates.values([False] * 3, size=1)[0] < 0.2
    rates.new_prompt()  # the next prompt starts from the run's rates, per match size
    assert rates.rate(0, size=3) > 0.8 and rates.rate(0, size=1) < 0.2
    assert 0.2 < rates.rate(0, size=2) < 0.8  # a size never seen: the run's rate over all sizes


def test_a_categorys_finished_prompts_price_its_next_prompts_chains():
    # Two categories alternate: "copy" prompts (translation-like) whose chains land at every depth, "fresh" ones (STEM
    # answers) whose chains miss at their first node. The run's rates pool both, about half; a new prompt of either
    # category starts from what its category's finished prompts did, one of no known category from the run's.
    rates = LookupDepths()
    for p in range(6):
        category = ("copy", "fresh")[p % 2]
        rates.new_prompt(category)
        for _ in range(6):
            if category == "copy":
                for depth in range(3):
                    rates.observe(depth, False, True, size=1)
            else:
                rates.observe(0, False, False, size=1)
    rates.new_prompt("copy")
    copy = rates.values([False] * 3, size=1)
    rates.new_prompt("fresh")
    fresh = rates.values([False] * 3, size=1)
    rates.new_prompt("")
    run = rates.values([False] * 3, size=1)
    assert 0.3 < run[0] < 0.7  # the premise: pooled, the first node is right about half the time
    assert copy[0] > run[0] + 0.25 and copy[2] > 1.5 * run[2]
    assert fresh[0] < run[0] - 0.25 and fresh[2] < 0.5 * run[2]
    rates.new_prompt("writing")  # a category with no finished prompt: the run's rates
    assert rates.values([False] * 3, size=1) == run


def test_the_runner_tells_a_hybrid_each_prompts_category(base: Verifier):  # noqa: F811
    from eval.runner import Runner

    primary = planned_medusa(base, random_heads(base), OPTIMISTIC, adaptive=True)
    hybrid = HybridDrafter(primary, PromptLookupDrafter(Chain(10), 10))
    runner = Runner(base, hybrid, 16, lookup=10)
    for i, category in enumerate(("copy", "fresh", "copy")):
        ids = base.tokenizer(PROMPTS[i % len(PROMPTS)], return_tensors="pt").input_ids[0].tolist()
        sample = runner.decode(ids, f"p{i}", category)
        assert sample.outputs["speculative"] == sample.outputs["baseline"]
        assert hybrid.lookup.category == category  # its chains were priced on its category's rates
    assert set(hybrid.lookup.categories) == {"copy", "fresh"}  # each finished prompt joined its category

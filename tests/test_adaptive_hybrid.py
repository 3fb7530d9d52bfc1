"""The hybrid's split chosen per round (eval/drafters/hybrid.py under a planned primary, eval/adaptive.py): lookup
chains and the drafter's nodes verified as what each has been accepting on the prompt says they are worth. On tiny
real verifiers: the output stays plain greedy's, a prompt whose answer lookup predicts verifies its chains beyond
the drafter's own budget and drops the drafter's worthless nodes, and a hybrid with no lookup source is refused."""

from __future__ import annotations

import pytest
from test_adaptive import OPTIMISTIC, PROMPTS, base, planned_medusa, random_heads, run_eval  # noqa: F401

from eval import cost
from eval.drafters.hybrid import HybridDrafter, LookupRate, split
from eval.drafters.lookup import PromptLookupDrafter
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import Chain
from models.verifier import Verifier
from runtime.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 48


def test_lookup_that_predicts_the_answer_takes_the_round(base: Verifier):  # noqa: F811
    # The tiny verifier repeats itself, so lookup's chains are right; random heads draft nothing it accepts.
    primary = planned_medusa(base, random_heads(base), OPTIMISTIC, adaptive=True)
    hybrid = HybridDrafter(primary, PromptLookupDrafter(Chain(10), 10))
    taus = []
    for text in PROMPTS:
        ids = base.tokenizer(text, return_tensors="pt").input_ids
        got = speculative_decode(base, hybrid, ids, MAX_NEW)
        assert got.tokens[0].tolist() == greedy_decode(base, ids, MAX_NEW).tokens[0].tolist()
        taus.append(got.tau)
        p = hybrid.prediction()
        assert p is not None and p.rounds == len(got.accept_lengths)
    k, m = hybrid.last_split
    assert hybrid.lookup.rate > 0.8 and k >= 5  # the chain verified ...
    assert k + m + 1 > primary.planned_nodes  # ... beyond the drafter's own budget, not in place of its nodes
    assert m < k and taus[-1] > 4.0


def test_the_split_follows_the_values():
    ms = lambda n: 10.0 + 0.5 * n  # noqa: E731
    drafter = [0.6, 0.3, 0.2, 0.1, 0.05]
    assert split([0.9 ** (i + 1) for i in range(8)], drafter, 63, ms)[0] == 8  # good lookup: all of its chain
    assert split([0.05 ** (i + 1) for i in range(8)], drafter, 63, ms)[0] == 0  # poor lookup: none of it
    k, m = split([0.7 ** (i + 1) for i in range(8)], drafter, 4)  # a fixed budget of 4: the 4 best of both
    assert (k, m) == (3, 1)  # 0.7, 0.6, 0.49, 0.343
    rate = LookupRate()
    for _ in range(20):
        rate.observe(0, 1)  # offered, never right
    assert rate.rate < 0.1
    rate.new_prompt()  # the prompt starts from the run's rate
    assert rate.rate < 0.15


def test_a_hybrid_with_no_lookup_source_is_refused(base, tmp_path, tmp_path_factory):  # noqa: F811
    from models.export import save_export

    export = save_export(random_heads(base), base, tmp_path_factory.mktemp("e") / "medusa",
                         {"medusa_topk_accuracy": OPTIMISTIC})
    for bad in ("drafter.num_tokens=0", "drafter.budget=1"):
        with pytest.raises(UserError, match=f"{bad} leaves no lookup source usable"):
            run_eval([f"checkpoint={export}", "drafter=hybrid", bad], tmp_path)
    report = run_eval([f"checkpoint={export}", "drafter=hybrid", "num_prompts=2"], tmp_path)
    assert report["method"].startswith("hybrid/hybrid-") and report["greedy_match"] == 1.0
    assert report["predicted_speedup"] is not None and report["tree"]["split"] == "per round"
    assert cost.PROBE_SIZE + 1 == report["tree"]["primary"]["max_nodes"]

"""Test-time updates (drafter.adapt=online, eval/drafters/online.py): the drafter learns from the verifier's tokens
while decoding; the output stays the verifier's, token for token under greedy, in law under sampling."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2_contingency

from eval.drafters.build import make_drafter
from eval.drafters.online import AdaptSettings, adapt_settings
from eval.engine.acceptance import sampled as sampling
from eval.engine.acceptance.sampled import RejectionPlan, rejection_plan
from eval.engine.decode import greedy_decode, sample_decode, speculative_decode
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import Chain, DynamicTree
from helpers import varied_llama
from models.eagle import build_eagle
from runtime.errors import UserError

PROMPTS = ["Hello, my name is", "def fib(n):\n    return", "The capital of France is Paris. The capital of"]
MAX_NEW = 40
FAST = AdaptSettings(lr=1e-2, every=8, window=64, depth=1)  # a learner quick enough to see within a few prompts


@pytest.fixture(scope="module")
def varied():
    return varied_llama()


@pytest.fixture(scope="module")
def references(varied):
    out = []
    for prompt in PROMPTS:
        ids = varied.tokenizer(prompt, return_tensors="pt").input_ids
        out.append((ids, greedy_decode(varied, ids, MAX_NEW).tokens[0].tolist()))
    return out


def random_net(kind: str, verifier, answers: list[list[int]], seed: int = 0):
    """Random drafter weights; EAGLE-3's draft vocabulary holds the verifier's answer tokens (so they can be
    learned) among random others."""
    net = build_eagle(kind, verifier, draft_vocab_size=4096 if kind == "eagle3" else None,
                      aux_layer_ids=[0, 1] if kind == "eagle3" else None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        if kind == "eagle3":
            wanted = torch.tensor(sorted({t for a in answers for t in a}))
            others = torch.randperm(verifier.vocab_size, generator=gen)
            others = others[~torch.isin(others, wanted)][: 4096 - wanted.numel()]
            net.set_draft_vocab(torch.cat([wanted, others]))
    return net


def learning_drafter(kind, verifier, answers, tree=None, settings=FAST, **options):
    drafter = make_drafter(kind, verifier, tree or Chain(3), net=random_net(kind, verifier, answers), **options)
    drafter.learn_online(settings)
    return drafter


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_learning_drafter_changes_its_weights_not_the_output(varied, references, kind, tree):
    answers = [ref for _, ref in references]
    drafter = learning_drafter(kind, varied, answers, Chain(3) if tree == "chain" else DynamicTree(size=8, depth=3))
    before = [p.detach().clone() for p in drafter.net.parameters()]
    for _ in range(2):  # the learner carries over from prompt to prompt
        for ids, ref in references:
            assert speculative_decode(varied, drafter, ids, MAX_NEW).tokens[0].tolist() == ref
    assert drafter.learner.updates >= 6
    assert any(not torch.equal(a, b) for a, b in zip(before, drafter.net.parameters()))
    learning = drafter.describe()["learning"]
    assert learning["updates"] == drafter.learner.updates and learning["update_ms"] > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_learner_lifts_acceptance_on_what_the_verifier_says_again(varied, references, kind):
    """The same prompts again: the verifier answers as before, and a drafter that learned the first pass accepts
    more of the second (a drafter that does not learn accepts exactly as much both times)."""
    answers = [ref for _, ref in references]
    drafter = learning_drafter(kind, varied, answers)
    taus = []
    for _ in range(4):
        results = [speculative_decode(varied, drafter, ids, MAX_NEW) for ids, _ in references]
        taus.append(sum(r.tau for r in results) / len(results))
    assert taus[-1] > taus[0] + 0.25, taus


def test_nothing_is_learned_inside_frozen(varied, references):
    """eval's uncounted warm-up decode runs under online.frozen(): the learner neither records nor learns there."""
    from eval.drafters import online

    drafter = learning_drafter("eagle3", varied, [ref for _, ref in references])
    with online.frozen():
        for ids, _ in references:
            speculative_decode(varied, drafter, ids, MAX_NEW)
    assert drafter.learner.updates == 0
    for ids, _ in references:
        speculative_decode(varied, drafter, ids, MAX_NEW)
    assert drafter.learner.updates > 0


def test_python_m_eval_learns_online_and_stays_exact(tmp_path, cache_dir):
    """The command line a user runs: the shipped EAGLE-3 learning while it decodes, its output still plain greedy's,
    what it learned in report.json."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "eval", f"checkpoint={root / 'pretrained' / 'eagle3-smollm2'}", "drafter=export",
           "drafter.adapt=online", "drafter.adapt_every=8", "tree=chain", "tree.depth=3", "prompts=builtin",
           "num_prompts=2", "max_new_tokens=32", "alone=false", "threads=1", "wandb.mode=disabled",
           f"cache_dir={cache_dir}", f"output_dir={out}"]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["greedy_match"] == 1.0
    learning = report["tree"]["learning"]
    assert learning["adapt"] == "online" and learning["every"] == 8 and learning["updates"] >= 2


def test_adapt_settings_are_checked_before_decoding(varied, references):
    assert adapt_settings(None) is None
    assert adapt_settings("online", adapt_lr=None, adapt_every=4) == AdaptSettings(every=4)
    with pytest.raises(UserError, match="drafter.adapt='yes'"):
        adapt_settings("yes")
    with pytest.raises(UserError, match="drafter.adapt_lr set with drafter.adapt=null"):
        adapt_settings(None, adapt_lr=1e-3)
    with pytest.raises(UserError, match="drafter.adapt_every=0"):
        adapt_settings("online", adapt_every=0)
    with pytest.raises(UserError, match="drafter.adapt_lr=5"):
        adapt_settings("online", adapt_lr=5)
    from models.medusa import MedusaHeads

    heads = MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=2, num_layers=1)
    with pytest.raises(UserError, match="cannot learn while it decodes yet"):
        make_drafter("medusa", varied, Chain(2), net=heads, adapt="online")


# -- sampled: the adapted drafter's rounds follow the verifier ---------------------------------------------------

CFG = SamplingConfig(temperature=1.0, top_k=4)
RUNS = 600


def _first_two(varied, drafter, ids, seed: int) -> tuple[int, int]:
    """The first two new tokens of a 3-token decode: the prefill draws the first from q, and the round after it
    verifies a draft for the second (a 2-token decode would verify none: its only round has no room for a draft)."""
    gen = torch.Generator().manual_seed(seed)
    if drafter is None:  # the verifier sampling by itself
        tokens = sample_decode(varied, ids, 3, sampling=CFG, generator=gen).tokens[0]
    else:
        tokens = speculative_decode(varied, drafter, ids, 3, sampling=CFG, generator=gen).tokens[0]
    return int(tokens[0]), int(tokens[1])


UNSEEN = "Once upon a time, in a land"  # not one of PROMPTS: the learner never saw what the verifier says here


def _law_p(varied, drafter) -> float:
    """The chi-squared p-value of the first two tokens after UNSEEN, speculative against plain sampling. On the
    prompts the learner trained on, its drafts come close to q itself, and even accepting every draft would pass."""
    ids = varied.tokenizer(UNSEEN, return_tensors="pt").input_ids
    spec = [_first_two(varied, drafter, ids, s) for s in range(RUNS)]
    plain = [_first_two(varied, None, ids, RUNS + s) for s in range(RUNS)]
    cells = sorted(set(spec) | set(plain))
    table = [[spec.count(c) for c in cells], [plain.count(c) for c in cells]]
    return float(chi2_contingency(table)[1])


@pytest.fixture(scope="module")
def adapted(varied, references):
    """An EAGLE-3 drafter that learned from sampled decodes of every prompt (its weights moved), drafting sampled."""
    answers = [ref for _, ref in references]
    drafter = learning_drafter("eagle3", varied, answers, sampling=CFG, generator=torch.Generator().manual_seed(3))
    for i, (ids, _) in enumerate(references * 2):
        speculative_decode(varied, drafter, ids, MAX_NEW, sampling=CFG, generator=torch.Generator().manual_seed(i))
    assert drafter.learner.updates > 0
    return drafter


def test_sampled_output_of_a_learning_drafter_follows_the_verifier(varied, references, adapted):
    assert _law_p(varied, adapted) > 0.01


def test_sampled_law_negative_control_accept_all_fails(varied, references, adapted, monkeypatch):
    def accept_all(*args):
        plan = rejection_plan(*args)
        return RejectionPlan(torch.ones_like(plan.accept_prob), plan.final, plan.children)

    monkeypatch.setattr(sampling, "rejection_plan", accept_all)
    assert _law_p(varied, adapted) < 1e-6

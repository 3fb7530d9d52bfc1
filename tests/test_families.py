"""Every drafter family beside Medusa and EAGLE: a draft model (a truncated copy of the verifier), prompt lookup,
lookahead, and the hybrid that grafts prompt lookup into another drafter's tree.

Greedy speculative decoding must give plain greedy's output token for token whatever a drafter proposes, so the
exactness tests run each drafter on the varied tiny verifier (whose output never repeats) over two prompts with the
same drafter object (its state must follow a new prompt). The acceptance tests use verifiers built for the case: the
plain tiny verifier repeats one token (prompt lookup and lookahead have something to find), a 4-layer varied verifier
whose last two layers barely change the residual (its first two layers are a good draft model, its first one is not).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_eagle_decode import random_net
from transformers import LlamaConfig, LlamaForCausalLM

from eval.drafters.build import Draft, make_drafter
from eval.drafters.draft_model import DraftModelDrafter, load_draft_model, make_draft_model_drafter
from eval.drafters.hybrid import HybridDrafter, graft
from eval.drafters.lookahead import LookaheadDrafter
from eval.drafters.lookup import PromptLookupDrafter, lookup
from eval.engine.acceptance.greedy import greedy_accept
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import AutoTree, Chain, DynamicTree, chain, from_medusa_choices, tree_buffers
from helpers import ROOT, varied_llama
from models.exports.io import save_export
from models.families import FAMILIES
from models.medusa import MedusaHeads
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError

TEXT = ["The quick brown fox jumps over the lazy dog.", "Write a short poem about rivers and the sea, please."]


@pytest.fixture(scope="module")
def varied():
    return varied_llama()


@pytest.fixture(scope="module")
def shallow(cache_dir):
    """4 varied layers, the last two scaled down to 1% of their output: the first two decide the next token."""
    v = build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", num_layers=4, seed=1, layer_std=0.3)
    with torch.no_grad():
        for layer in v.model.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.01)
    return v


def _ids(verifier, text: str) -> torch.Tensor:
    return torch.tensor([verifier.tokenizer(text).input_ids])


def _random_medusa(verifier):
    heads = MedusaHeads(verifier.hidden_size, verifier.vocab_size, num_heads=3)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return make_drafter("medusa", verifier, from_medusa_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]]), net=heads)


DRAFTERS = {
    "draft_model": lambda v: make_draft_model_drafter(v, Chain(3), layers=1),
    "prompt_lookup": lambda v: PromptLookupDrafter(Chain(), num_tokens=4),
    "lookahead": lambda v: LookaheadDrafter(window=4, ngram=3, guesses=3),
    "lookahead_pool_from_prompt": lambda v: LookaheadDrafter(window=4, ngram=3, guesses=3, pool_from_prompt=True),
    "hybrid_medusa": lambda v: HybridDrafter(_random_medusa(v), PromptLookupDrafter(Chain(), num_tokens=3)),
    "hybrid_eagle3": lambda v: HybridDrafter(make_drafter("eagle3", v, DynamicTree(size=8, depth=3, topk=4),
                                                          net=random_net("eagle3", v)),
                                             PromptLookupDrafter(Chain(), num_tokens=3)),
    "hybrid_draft_model": lambda v: HybridDrafter(make_draft_model_drafter(v, Chain(3), layers=1),
                                                  PromptLookupDrafter(Chain(), num_tokens=3), budget=7),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_each_family_gives_plain_greedy_output(varied, name, one_thread):
    drafter = DRAFTERS[name](varied)
    for text in TEXT:  # the same drafter object on a second prompt: its state must start over
        x = _ids(varied, text)
        want = greedy_decode(varied, x, 30).tokens
        got = speculative_decode(varied, drafter, x, 30)
        assert torch.equal(got.tokens, want), name
        assert got.num_forwards <= 31


def test_lookup_takes_the_longest_then_earliest_match():
    seq = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 5, 6, 7]
    assert lookup(seq, 3, max_ngram_size=3) == [8, 9, 1]  # (5, 6, 7) first occurs at 0
    assert lookup(seq, 10, max_ngram_size=3) == [8, 9, 1, 2, 6, 7, 3, 5, 6, 7]
    assert lookup([5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7], 2) == [8, 5]  # the earliest of two matches, as HF
    assert lookup([1, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7], 2) == [9, 5]  # the 3-gram before the earlier 2-gram
    assert lookup([4, 1, 2, 9, 1, 2], 2, max_ngram_size=3) == [9, 1]  # no 3-gram (4, 1, 2) ... falls to (1, 2)
    assert lookup([4, 1, 2, 9, 1, 2], 2, max_ngram_size=3, min_ngram_size=3) == []
    assert lookup([1, 2, 3], 4) == []
    assert lookup([7], 4) == [] and lookup([], 4) == []


def _lookup_by_loop(tokens: list[int], num_tokens: int, max_n: int, min_n: int) -> tuple[list[int], int]:
    """Hugging Face's PromptLookupCandidateGenerator's rule written as the plain loop it is."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + num_tokens], n
    return [], 0


def test_lookup_search_is_the_loop_it_replaces():
    """The vectorised search (a long prompt costs microseconds) finds what the position-by-position loop finds, and
    its n-gram size, on lists and tensors: random texts over small vocabularies, so matches of every size occur."""
    from eval.drafters.lookup import match

    rng = random.Random(0)
    for _ in range(400):
        vocab, length = rng.choice([2, 3, 5, 40]), rng.randint(1, 60)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        max_n = rng.randint(1, 4)
        min_n, num = rng.randint(1, max_n), rng.randint(1, 12)
        want = _lookup_by_loop(tokens, num, max_n, min_n)
        assert match(tokens, num, max_n, min_n) == want, (tokens, num, max_n, min_n)
        assert match(torch.tensor(tokens, dtype=torch.long), num, max_n, min_n) == want


def test_prompt_lookup_accepts_when_the_text_repeats(tiny, one_thread):
    """The plain tiny verifier mostly repeats the prompt's last token, which the prompt holds nowhere else: lookup
    must find the repetition in the generated text (a lookup over the prompt alone would draft nothing)."""
    x = _ids(tiny, TEXT[0])
    want = greedy_decode(tiny, x, 40).tokens
    assert x[0].tolist().count(want[0, 0].item()) == 1
    got = speculative_decode(tiny, PromptLookupDrafter(Chain(), num_tokens=6), x, 40)
    assert torch.equal(got.tokens, want)
    assert got.tau > 1.5


def test_lookahead_pool_fills_from_jacobi_steps(tiny, one_thread):
    x = _ids(tiny, TEXT[0])
    drafter = LookaheadDrafter(window=4, ngram=3, guesses=3)
    got = speculative_decode(tiny, drafter, x, 40)
    assert torch.equal(got.tokens, greedy_decode(tiny, x, 40).tokens)
    assert drafter.pool and got.tau > 1.5


def test_truncated_copy_accepts_when_its_layers_decide(shallow, one_thread):
    x = _ids(shallow, TEXT[0])
    want = greedy_decode(shallow, x, 40).tokens
    taus = {}
    for k in (1, 2):
        drafter = make_draft_model_drafter(shallow, Chain(4), layers=k)
        got = speculative_decode(shallow, drafter, x, 40)
        assert torch.equal(got.tokens, want)
        taus[k] = got.tau
        # Rolled back: the draft cache holds verified tokens only, as many as its keys.
        seq = torch.cat([x, got.tokens], dim=1)[0].tolist()
        assert drafter.cached == seq[: len(drafter.cached)]
        assert drafter.cache.get_seq_length() == len(drafter.cached)
    assert taus[2] > 3.0 and taus[1] < 1.5, taus  # two layers decide the token here, one does not


def test_graft_accepts_what_either_tree_would(varied):
    """One round, crafted logits: the verifier follows the grafted chain in one case, the primary's second branch
    in the other; the merged tree accepts as much as the better part. Within the primary's own node budget the
    grafted chain stays whole and the primary keeps its first (best) nodes."""
    v = varied.vocab_size
    primary = Draft(tree=from_medusa_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
                    tokens=torch.tensor([[7, 10, 20, 11, 21, 12]]))  # paths 10-11-12 and 20-21
    extra = Draft(tree=chain(3), tokens=torch.tensor([[7, 30, 31, 10]]))

    def accepted(d: Draft, follow: dict[int, int]) -> int:
        logits = torch.zeros(1, d.tree.num_nodes, v)
        for i, t in enumerate(d.tokens[0].tolist()):
            logits[0, i, follow.get(t, 0)] = 1.0  # the verifier's next token after t
        return int(greedy_accept(tree_buffers(d.tree).retrieve, d.tokens, logits).num_accepted[0])

    merged, origin = graft(primary, extra, budget=9)
    assert merged.tree.num_nodes == 9 and origin.count(-1) == 3 and origin[:6] == list(range(6))
    for follow in ({7: 30, 30: 31, 31: 10, 10: 5}, {7: 20, 20: 21, 21: 99}, {7: 10, 10: 11, 11: 12}):
        both = max(accepted(primary, follow), accepted(extra, follow))
        assert accepted(merged, follow) >= both > 0, follow
    tight, origin = graft(primary, extra, budget=primary.tree.num_nodes)
    assert tight.tree.num_nodes == 6 and origin == [0, 1, 2, -1, -1, -1]
    assert accepted(tight, {7: 30, 30: 31, 31: 10, 10: 5}) == 3 and accepted(tight, {7: 20, 20: 21}) == 1
    again, _ = graft(primary, Draft(tree=chain(2), tokens=torch.tensor([[7, 10, 11]])), budget=6)
    assert again.tree == primary.tree  # a chain already in the tree merges into it: nothing dropped
    small, _ = graft(primary, Draft(tree=chain(2), tokens=torch.tensor([[7, 10, 11]])), budget=3)
    assert small.tokens.tolist() == [[7, 10, 11]]  # the grafted path survives the cut though it adds no node


@pytest.mark.parametrize("case", ["lookup_wins", "draft_model_wins"])
def test_hybrid_is_at_least_as_good_as_each_part(tiny, shallow, case, one_thread):
    """On the repeating tiny verifier prompt lookup drafts well and random Medusa heads badly; on `shallow` a
    two-layer draft model drafts well and lookup finds nothing. The hybrid's tau is at least the better part's."""
    if case == "lookup_wins":
        v, primary = tiny, lambda: _random_medusa(tiny)
    else:
        v, primary = shallow, lambda: make_draft_model_drafter(shallow, Chain(4), layers=2)
    x = _ids(v, TEXT[0])
    want = greedy_decode(v, x, 40).tokens
    parts = {"primary": primary(), "lookup": PromptLookupDrafter(Chain(), num_tokens=4)}
    taus = {}
    for name, d in [*parts.items(), ("hybrid", HybridDrafter(primary(), PromptLookupDrafter(Chain(), num_tokens=4),
                                                             budget=10))]:
        got = speculative_decode(v, d, x, 40)
        assert torch.equal(got.tokens, want), name
        taus[name] = got.tau
    assert taus["hybrid"] >= max(taus["primary"], taus["lookup"]) - 1e-6, taus
    assert max(taus.values()) > 1.5, taus


def test_hybrid_grafts_chains_as_long_as_prompt_lookup_within_its_budget(varied, tmp_path):
    """conf/drafter/hybrid.yaml's default grafts prompt-lookup chains as long as drafter=prompt_lookup's own (a
    shorter chain cost the hybrid tau on translation, where the answer copies the prompt), capped by the budget."""
    from omegaconf import OmegaConf

    from eval.drafters.build import CONF
    from eval.drafters.hybrid import hybrid as build_hybrid
    from eval.drafters.lookup import prompt_lookup

    export = save_export(MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=3), varied, tmp_path / "m",
                         {"medusa_topk_accuracy": [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4]]})
    defaults = {k: v for k, v in OmegaConf.load(CONF / "hybrid.yaml").items() if not k.startswith("_")}
    lookup = prompt_lookup(varied, Chain(), **{k: v for k, v in OmegaConf.load(
        CONF / "prompt_lookup.yaml").items() if not k.startswith("_")})
    hybrid = build_hybrid(varied, AutoTree(size=12), export, **defaults)
    assert hybrid.max_nodes == 13 and hybrid.extra.num_tokens == lookup.num_tokens == 10
    small = build_hybrid(varied, AutoTree(size=4), export, **defaults)  # 5 nodes: the root and 4 grafted drafts
    assert small.max_nodes == 5 and small.extra.num_tokens == 4
    x = _ids(varied, TEXT[0] + " " + TEXT[0])  # the text repeats: the lookup chain is found and fits
    assert torch.equal(speculative_decode(varied, hybrid, x, 20).tokens, greedy_decode(varied, x, 20).tokens)


def test_draft_model_with_another_vocabulary_is_refused(varied, tmp_path):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(UserError, match="different vocabulary"):
        DraftModelDrafter(other, varied, Chain(3))
    # Same size but one more token in the tokenizer: the ids would not mean the verifier's.
    model_dir = tmp_path / "other"
    tokenizer = _tokenizer_with_extra(varied, model_dir)
    same = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    same.save_pretrained(model_dir)
    with pytest.raises(UserError, match="different vocabulary"):
        load_draft_model(varied, str(model_dir))


def _tokenizer_with_extra(verifier, directory: Path):
    import copy

    tokenizer = copy.deepcopy(verifier.tokenizer)
    tokenizer.add_tokens(["<not-in-the-verifier>"])
    tokenizer.save_pretrained(directory)
    return tokenizer


def test_bad_shapes_are_refused(varied):
    with pytest.raises(UserError, match="does not fit a draft model"):
        make_draft_model_drafter(varied, AutoTree(8), layers=1)
    with pytest.raises(UserError, match="keeps between 1 and 1"):
        make_draft_model_drafter(varied, Chain(3), layers=2)
    with pytest.raises(UserError, match="min_ngram_size"):
        PromptLookupDrafter(Chain(), max_ngram_size=1, min_ngram_size=2)
    with pytest.raises(UserError, match="cannot hold"):
        HybridDrafter(make_draft_model_drafter(varied, Chain(2), layers=1), PromptLookupDrafter(Chain(), 5))


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval", *args, "threads=1", "wandb.mode=disabled",
                           f"output_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["medusa without export", "draft model with another vocabulary"])
def test_cli_bad_input_is_one_clear_error(varied, tmp_path, case):
    if case == "medusa without export":
        args, expected = ["drafter=medusa", "verifier_path={loader: tiny}"], "checkpoint=<export dir> is required"
    else:
        _tokenizer_with_extra(varied, tmp_path / "other")
        LlamaForCausalLM(LlamaConfig(vocab_size=len(varied.tokenizer) + 1, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1)).save_pretrained(tmp_path / "other")
        args = ["drafter=draft_model", f"drafter.path={tmp_path / 'other'}", "verifier_path={loader: tiny}"]
        expected = "different vocabulary"
    proc = _cli(args, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_method_all_rows_per_position_acceptance_and_per_round_times():
    """The comparison rows from known rounds: alpha_k = the share of rounds with >= k drafts accepted (zero past the
    deepest accepted, up to the drafter's depth), drafter and verify ms per round = their seconds over the rounds."""
    import torch

    from eval.report import Sample, rows

    def sample(lengths, draft_s, verify_s):
        n = int(sum(lengths) + len(lengths))
        return Sample("p", "c", 0, 8, {"baseline": 2.0, "d": 1.0}, {"baseline": [1] * n, "d": [1] * n},
                      {"d": torch.tensor(lengths)}, {"baseline": n, "d": len(lengths)},
                      {"d": {"draft_s": draft_s, "verify_s": verify_s, "prefill_s": 0.1}})

    out = rows([sample([0, 2, 3], 0.03, 0.06), sample([1], 0.01, 0.02)], ["d"], {"d": 5})["d"]
    assert out["accept_rate_per_position"] == [0.75, 0.5, 0.25, 0.0, 0.0]
    assert out["tau"] == pytest.approx(1 + sum(out["accept_rate_per_position"]))  # 2.5
    assert out["draft_ms_per_round"] == pytest.approx(10.0) and out["verify_ms_per_round"] == pytest.approx(20.0)
    assert out["speedup"] == pytest.approx(2.0) and rows([sample([0], 0.0, 0.0)], ["d"])["baseline"]["tau"] is None


def test_method_all_runs_every_family_on_the_same_prompts(varied, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    export = save_export(MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=3), varied, tmp_path / "m",
                         {"medusa_topk_accuracy": [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4]]})
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            "method=all", f"checkpoint={export}", "prompts=[builtin,humaneval]", "num_prompts=1", "max_new_tokens=10",
            "threads=1", "warmup=false",
            "dtype=float32",  # HF generate and assisted generation match ours token for token in fp32 only
            "wandb.mode=disabled", "drafter=draft_model", "drafter.layers=1", f"output_dir={tmp_path / 'out'}"])
    report = evaluate(cfg, progress=False)
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report
    assert (tmp_path / "out" / "families.png").stat().st_size > 0
    families = {m.split("/")[0] for m in report["methods"]}
    assert families == {"baseline", "medusa", "draft_model", "prompt_lookup", "lookahead", "hybrid", "hf_generate",
                        "hf_prompt_lookup", "hf_assisted"}
    assert report["trees"]["draft_model/chain-4"]["draft_model"].endswith("[:1]")  # drafter= kept its options
    # tree.size=auto (the default) plans each export family as a single run would (test below); the rest draft
    # their own shapes
    assert {m.split("/")[0] for m in report["plans"]} == {"medusa", "hybrid"}, report["plans"]
    assert all(m in report["methods"] for m in report["plans"])
    for name, row in report["methods"].items():
        assert row["greedy_match"] == 1.0, name
        assert row["tokens_per_s"] > 0 and (row["tau"] is None) == (name in ("baseline", "hf_generate",
                                                                            "hf_prompt_lookup", "hf_assisted"))
    assert set(report["by_category"]) and all(set(r) == set(report["methods"]) for r in report["by_category"].values())
    assert sum(1 for _ in report["by_prompt_length"]) >= 1
    # prompts=[a, b]: each set drawn apart (num_prompts from each), its categories prefixed, a row set per set
    assert report["num_prompts"] == 2 and list(report["by_prompt_set"]) == ["builtin", "humaneval"]
    assert all(c.split("/")[0] in ("builtin", "humaneval") for c in report["by_category"])
    assert all(set(r) == set(report["methods"]) for r in report["by_prompt_set"].values())
    assert all(set(r) == set(report["methods"]) for r in report["by_prompt_length"].values())
    for name, row in report["methods"].items():
        if row["tau"] is None:
            assert row["accept_rate_per_position"] is row["draft_ms_per_round"] is row["verify_ms_per_round"] is None
            continue
        alpha = row["accept_rate_per_position"]  # alpha_k = P(k-th draft accepted): tau = 1 + sum_k alpha_k
        assert alpha == sorted(alpha, reverse=True) and row["tau"] == pytest.approx(1 + sum(alpha), abs=1e-3), name
        assert row["draft_ms_per_round"] > 0 and row["verify_ms_per_round"] > 0, name
    for name, row in report["methods"].items():  # our loops' prefill apart; HF's calls cannot be split
        ours = not name.startswith("hf_")
        assert (row["prefill_s"] is not None) == ours and (not ours or row["prefill_s"] > 0), name
        assert not ours or row["decode_tokens_per_s"] > 0, name


def test_method_all_keeps_a_row_per_export_of_one_family(varied, tmp_path):
    """Two exports of one family side by side (two EAGLE-3 runs, a 1- and a 3-layer DFlash): each keeps its own row,
    labelled with its run's folder, where one label would have let the second overwrite the first."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    table = {"medusa_topk_accuracy": [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4]]}
    torch.manual_seed(0)
    first = save_export(MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=3), varied,
                        tmp_path / "run-a" / "export", table)
    second = save_export(MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=2), varied, tmp_path / "run-b",
                         table)
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            "method=all", f"checkpoint=[{first},{second}]", "num_prompts=1", "max_new_tokens=6", "threads=1",
            "warmup=false", "dtype=float32", "wandb.mode=disabled", "drafter=draft_model", "drafter.layers=1",
            "tree.size=4", f"output_dir={tmp_path / 'out'}"])
    report = evaluate(cfg, progress=False)
    medusa = sorted(m for m in report["methods"] if m.startswith("medusa/"))
    assert [m.split("@")[-1] for m in medusa] == ["run-a", "run-b"], medusa
    assert report["trees"][medusa[0]] != report["trees"][medusa[1]]  # 3 heads against 2: each its own drafter
    assert all(report["methods"][m]["greedy_match"] == 1.0 for m in medusa)


@pytest.mark.parametrize("slope", [0.0, 8.0], ids=["flat-verify-cost", "steep-verify-cost"])
def test_method_all_plans_each_export_familys_budget_on_the_run_curve(varied, tmp_path, monkeypatch, slope):
    """tree.size=auto under method=all: each export family gets the budget a single run plans, on one verifier
    curve, its own acceptance table and its own draft curve (here a given curve, to know the answer): a flat verify
    cost buys every node the table holds, a steep one a few; the hybrid plans at least one draft for its graft."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate
    from eval.planner import cost

    table = [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4]]
    export = save_export(MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=3), varied, tmp_path / "m",
                         {"medusa_topk_accuracy": table})
    sizes = list(cost.SIZES)
    ms = [10.0 + slope * (n - 1) for n in sizes]
    measured = []

    def fake_measure(verifier, prefix, threads, engine="auto", *args, **kwargs):
        measured.append(prefix.shape)
        return cost.Curve("float32", threads, "hf", sizes, ms, ms, ms, {})

    monkeypatch.setattr(cost, "measure", fake_measure)
    monkeypatch.setattr(cost, "draft_curve", lambda *a, **k: [0.0] * len(sizes))
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            "method=all", f"checkpoint={export}", "num_prompts=1", "max_new_tokens=6", "threads=1", "warmup=false",
            "dtype=float32", "wandb.mode=disabled", "drafter=draft_model", "drafter.layers=1", "plan=static",
            f"output_dir={tmp_path / 'out'}"])
    report = evaluate(cfg, progress=False)
    assert len(measured) == 1  # one verifier curve serves every family
    want = {f: cost.best_size(sizes, ms, table, draft=[0.0] * len(sizes), min_drafts=FAMILIES[f].min_drafts).size
            for f in ("medusa", "hybrid")}
    got = {m.split("/")[0]: p["size"] for m, p in report["plans"].items()}
    assert got == want, (got, want)
    assert (want["medusa"] == 14) == (slope == 0.0)  # flat: all 14 nodes the 3-head top-2 table holds
    assert "medusa/auto-" + str(want["medusa"]) in report["methods"] and want["hybrid"] >= 1
    assert all(row["greedy_match"] == 1.0 for row in report["methods"].values())


def test_method_all_samples_every_method_as_a_single_run_does(varied, tmp_path):
    """method=all decodes through the single-family run's path: temperature (and the engine) reach every method."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    export = save_export(MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=3), varied, tmp_path / "m",
                         {"medusa_topk_accuracy": [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4]]})

    def outputs(*extra: str) -> tuple[dict, list[dict[str, list[int]]]]:
        out = tmp_path / "-".join(e.replace("=", "_") for e in extra or ("greedy",))
        GlobalHydra.instance().clear()
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            cfg = compose(config_name="eval", overrides=[
                "method=all", f"checkpoint={export}", "num_prompts=3", "max_new_tokens=12", "threads=1",
                "warmup=false", "dtype=float32", "wandb.mode=disabled", "drafter=draft_model", "drafter.layers=1",
                "tree.size=6", f"output_dir={out}", *extra])
        report = evaluate(cfg, progress=False)
        lines = (out / "outputs.jsonl").read_text().splitlines()
        return report, [json.loads(line)["outputs"] for line in lines]

    greedy_report, greedy = outputs()
    sampled_report, sampled = outputs("temperature=0.7")
    assert greedy_report["sampling"]["rule"] == "greedy"
    assert sampled_report["sampling"]["rule"] == "rejection sampling (exact)"
    methods = list(sampled_report["methods"])
    assert len(methods) == 9 and methods == list(greedy_report["methods"])
    for m in methods:  # every method sampled: some prompt's output is not its greedy output
        assert any(s[m] != g[m] for s, g in zip(sampled, greedy)), m
        assert all(g[m] == g["baseline"] for g in greedy), m  # greedy: every method is exact
    # the same seed samples the same tokens again: the sampled run is reproducible
    assert outputs("temperature=0.7", "seed=0")[1] == sampled


def test_hybrid_on_a_medusa_export_plans_its_budget_from_the_heads_table(varied, tmp_path):
    # tree.size=auto (the default) plans the hybrid's budget from its primary's table, here a Medusa export's top-k
    # table, at least one draft: the grafted lookup chain needs a node.
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    export = save_export(MedusaHeads(varied.hidden_size, varied.vocab_size, num_heads=3), varied, tmp_path / "m",
                         {"medusa_topk_accuracy": [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4]]})
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            "drafter=hybrid", f"checkpoint={export}", "num_prompts=1", "max_new_tokens=10", "threads=1",
            "warmup=false", "dtype=float32", "wandb.mode=disabled", f"output_dir={tmp_path / 'out'}"])
    report = evaluate(cfg, progress=False)
    model = json.loads((tmp_path / "out" / "profile.json").read_text())["cost_model"]
    assert model["tree_size_auto"] and 1 <= model["size"] <= 14  # the table's tree holds 14 drafts at most
    assert model["draft_ms"] > 0 and len(set(model["draft_curve_ms"])) == 1  # its Medusa heads' time, once a round
    # the round's budget is chosen per round on top of that plan (eval/drafters/hybrid.py): the label gives its cap
    assert report["method"] == f"hybrid/hybrid-{report['tree']['max_nodes'] - 1}" and report["greedy_match"] == 1.0
    assert report["tree"]["split"] == "per round"


def test_prompt_sets_are_drawn_apart_and_named_once():
    from data.prompts import load_prompt_sets

    both = load_prompt_sets(["builtin", "humaneval"], 3)
    assert [c.category.split("/")[0] for c in both] == ["builtin"] * 3 + ["humaneval"] * 3
    assert [c.messages for c in both[:3]] == [c.messages for c in load_prompt_sets("builtin", 3)]
    with pytest.raises(UserError, match="two sets share the name"):
        load_prompt_sets(["builtin", "builtin"], 2)
    with pytest.raises(UserError, match="at least one prompt set"):
        load_prompt_sets([], 2)

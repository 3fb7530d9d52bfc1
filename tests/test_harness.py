"""The evaluation harness (`python -m eval`): report.json's exact keys and sane values, per-category breakdowns,
multi-turn prompts, the HumanEval source, W&B logging, and one clear error per bad input through the real command
line. Most tests use the tiny verifier with saved Medusa exports (random heads that draft badly, fresh heads that
draft perfectly on it) and one thread; one slow test trains `experiment=smoke` and evaluates the default verifier.

The tiny verifier repeats one token, so a wrong KV cache would still give `greedy_match` 1.0 there. The exactness
tests therefore also run the harness's decode and report code on a verifier whose output varies (conftest's
`varied_llama`), handing it the verifier and drafter as objects (`Runner`, `run_prompts`, `write_outputs`, what
`evaluate` runs after loading), with negative controls that break the KV commit and must lower `greedy_match`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.prompts import Conversation, load_conversations, select_prompts
from eval.drafters.build import Draft, Drafter, make_drafter
from eval.engine import decode, session
from eval.engine import hf_forward as kv
from eval.engine.tree import Tree, auto_tree, from_medusa_choices
from eval.harness import evaluate
from eval.report import REPORT_KEYS, RUN_KEYS, write_outputs
from eval.runner import Runner, run_prompts
from helpers import ROOT, varied_llama
from models.exports.io import save_export
from models.medusa import MedusaHeads
from models.verifiers.core import Verifier

ACCURACY = [[0.6, 0.75, 0.8, 0.83], [0.45, 0.55, 0.6, 0.62], [0.35, 0.42, 0.46, 0.5], [0.25, 0.3, 0.33, 0.35]]
METRIC_KEYS = set(REPORT_KEYS) - {"method", "tree", "verifier", "checkpoint", "drafter_dtype", "sampling",
                                   "by_category", "by_prompt_length", "by_prompt_set", *RUN_KEYS}
FAST = ["threads=1", "max_new_tokens=12", "wandb.mode=disabled", "dtype=float32"]  # fp32: HF generate is exact too


@pytest.fixture(scope="module")
def exports(tiny, tmp_path_factory) -> dict[str, Path]:
    """`random`: heads far from the verifier's (drafts nearly always rejected); `fresh`: zero-initialised heads,
    i.e. the verifier's own head, whose drafts the repetitive tiny verifier always accepts."""
    root = tmp_path_factory.mktemp("exports")
    random_heads = MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in random_heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    fresh = MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=4)
    extra = {"medusa_topk_accuracy": ACCURACY}
    return {"random": save_export(random_heads, tiny, root / "random", extra),
            "fresh": save_export(fresh, tiny, root / "fresh", extra)}


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    """An MT-bench style question.jsonl: two categories, two turns each."""
    path = tmp_path_factory.mktemp("prompts") / "question.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [f"Tell me about {topic}.", "Now say it in one sentence."]}
            for i, (cat, topic) in enumerate([("writing", "autumn"), ("math", "primes"), ("writing", "rivers"),
                                              ("math", "triangles")])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_eval(overrides: list[str], out: Path, default_drafter: bool = False) -> tuple[dict, dict]:
    """Compose conf/eval.yaml as the command line would and run it in-process; returns (report, profile). These
    tests measure the export's drafter alone (`drafter=export`) unless they name a drafter or ask for the default
    (the hybrid with the drafter alone beside it)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    alone = [] if default_drafter or any(o.startswith("drafter=") for o in overrides) else ["drafter=export"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[*FAST, *alone, *overrides, f"output_dir={out}"])
    report = evaluate(cfg, progress=False)
    assert json.loads((out / "report.json").read_text()) == report
    return report, json.loads((out / "profile.json").read_text())


def _check_sane(report: dict, depth: int, profile: dict | None = None) -> None:
    assert list(report) == list(REPORT_KEYS)
    # a round's parts beside a plain step (ms), and with profile.json, as its time breakdown counts them: a round is a
    # verifier forward after the prefill (one a prompt), whose verify and draft seconds the breakdown sums
    assert report["draft_ms_per_round"] > 0 and report["verify_ms_per_round"] > 0 and report["plain_step_ms"] > 0
    if profile is not None:
        spec, plain = profile["time_breakdown"]["speculative"], profile["time_breakdown"]["baseline"]
        rounds = spec["verifier_forwards"] - report["num_prompts"]
        assert report["verify_ms_per_round"] == pytest.approx(spec["ms_per_verifier_forward"], abs=2e-3)
        assert report["draft_ms_per_round"] == pytest.approx(1000 * spec["draft_s"] / rounds, rel=1e-3, abs=2e-3)
        assert report["plain_step_ms"] == pytest.approx(plain["ms_per_verifier_forward"], abs=2e-3)
    groups = report["by_prompt_length"]
    assert sum(m["num_prompts"] for m in groups.values()) == report["num_prompts"]
    assert sum(m["prompt_tokens"] for m in groups.values()) == report["prompt_tokens"] > 0
    for metrics in [report, *report["by_category"].values(), *groups.values()]:
        assert set(metrics) >= METRIC_KEYS
        for loop in ("baseline", "speculative"):  # the prefill timed apart from the decoding after it
            pre = metrics["prefill"][loop]
            assert pre["seconds"] > 0 and pre["prompt_tokens_per_s"] > 0 and pre["decode_tokens_per_s"] > 0
        assert metrics["greedy_match"] == 1.0 and metrics["tau"] >= 1.0
        alpha = metrics["accept_rate_per_position"]
        assert len(alpha) == depth and all(0.0 <= a <= 1.0 for a in alpha)
        assert all(a >= b for a, b in zip(alpha, alpha[1:]))  # alpha_k can only fall with k
        rates = [metrics[k] for k in ("tokens_per_s", "baseline_tokens_per_s", "hf_generate_tokens_per_s",
                                      "hf_prompt_lookup_tokens_per_s")]
        assert all(r > 0 for r in rates)
        assert metrics["speedup"] == pytest.approx(rates[0] / rates[1], rel=1e-2)
        assert metrics["speedup_vs_hf_generate"] == pytest.approx(rates[0] / rates[2], rel=1e-2)
    # per prompt, in the order decoded, and acceptance per 64-token window of the output: the same rounds
    rows = [r for r in report["per_prompt"] if r["method"] == "speculative"]
    assert len(rows) == report["num_prompts"] and sum(r["new_tokens"] for r in rows) == report["new_tokens"]
    assert {r["method"] for r in report["per_prompt"]} >= {"baseline", "speculative", "hf_generate"}
    windows = report["accept_by_window"]["speculative"]
    assert [w["window"][0] for w in windows] == [64 * i for i in range(len(windows))]
    assert sum(w["rounds"] for w in windows) == sum(r["rounds"] for r in rows)
    tau = sum(w["tau"] * w["rounds"] for w in windows) / sum(w["rounds"] for w in windows)
    assert tau == pytest.approx(report["tau"], abs=1e-3)


def test_acceptance_is_counted_in_the_window_of_the_output_position_each_round_starts_at():
    """The prefill emits position 0; a round starting at position p falls in window p // 64. Rounds here start at
    1 (62 accepted: 63 tokens, to position 63), 64 and 65: one round in the first window, two in the second (a
    count from position 0 would put two in the first)."""
    import torch

    from eval.report import Sample, accept_by_window, per_prompt

    sample = Sample(id="p0", category="c", turn=0, prompt_tokens=5, seconds={"baseline": 1.0, "speculative": 0.5},
                    outputs={"baseline": [0] * 70, "speculative": [0] * 70},
                    lengths={"speculative": torch.tensor([62, 0, 4])}, forwards={"baseline": 70, "speculative": 4})
    assert accept_by_window([sample], "speculative") == [{"window": [0, 63], "rounds": 1, "tau": 63.0},
                                                         {"window": [64, 127], "rounds": 2, "tau": 3.0}]
    assert per_prompt([sample]) == [
        {"id": "p0", "category": "c", "turn": 0, "method": "baseline", "new_tokens": 70, "rounds": 70, "tau": None,
         "tokens_per_s": 70.0},
        {"id": "p0", "category": "c", "turn": 0, "method": "speculative", "new_tokens": 70, "rounds": 3,
         "tau": 23.0, "tokens_per_s": 140.0}]


def test_the_long_output_setting_asks_for_1024_new_tokens_and_the_command_line_still_wins():
    """`setting=long_output` (conf/setting/long_output.yaml), parsed as a run parses its config: 1,024 new tokens over
    8 prompts, so accept_by_window has 16 windows a prompt; a key given beside it keeps its value."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.settings import parse

    parsed = {}
    for name, overrides in (("long", ["setting=long_output"]), ("mine", ["setting=long_output", "num_prompts=2"]),
                            ("default", [])):
        GlobalHydra.instance().clear()
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            parsed[name] = parse(compose(config_name="eval", overrides=["dtype=float32", *overrides]))
    assert (parsed["long"].max_new_tokens, parsed["long"].num_prompts) == (1024, 8)
    assert (parsed["mine"].max_new_tokens, parsed["mine"].num_prompts) == (1024, 2)
    assert (parsed["default"].max_new_tokens, parsed["default"].num_prompts) == (128, 20)


@pytest.mark.parametrize("tree", [["tree=auto", "tree.size=8"], ["tree=chain"]], ids=["auto", "chain"])
def test_random_heads_report_is_exact_and_sane(exports, tmp_path, tree):
    report, profile = run_eval([f"checkpoint={exports['random']}", "num_prompts=3", *tree], tmp_path)
    # auto-8 from ACCURACY is 3 deep, a chain 4
    _check_sane(report, depth=profile["tree"]["max_depth"], profile=profile)
    assert report["num_prompts"] == 3 and report["new_tokens"] == 36
    assert report["verifier"] == "tiny-llama-2x64-seed0" and report["checkpoint"] == str(exports["random"])
    assert report["method"] == ("medusa/auto-8" if "tree=auto" in tree else "medusa/chain-4")
    assert report["tau"] < 1.5  # bad drafts, still the verifier's own output
    # Every method, HF's included, emits the plain greedy tokens in fp32.
    assert set(profile["match_plain_greedy"].values()) == {1.0}
    spec = profile["time_breakdown"]["speculative"]
    parts = sum(spec[k] for k in ("prefill_s", "verify_s", "draft_s", "accept_s", "commit_s", "other_s"))
    assert parts == pytest.approx(spec["total_s"], abs=1e-3) and spec["verifier_forwards"] > 3
    for png in ("accept_length_hist.png", "accept_per_position.png", "tokens_per_s.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_good_heads_are_accepted(exports, tmp_path):
    report, _ = run_eval([f"checkpoint={exports['fresh']}", "num_prompts=2", "tree=chain"], tmp_path)
    _check_sane(report, depth=4)
    # 12 tokens per prompt: the prefill's, two rounds of 5, and a last round cut to the 1 token left (no draft).
    assert report["tau"] == pytest.approx(11 / 3, abs=1e-3)
    assert report["accept_rate_per_position"] == pytest.approx([2 / 3] * 4, abs=1e-3)


def test_an_export_runs_combined_with_lookup_and_reports_both_parts_alone(exports, tmp_path):
    """`python -m eval checkpoint=<export>`: the export's drafter with prompt-lookup chains (the hybrid), and each
    part decoded by itself beside it on the same prompts: report.json's drafter_alone is exactly what a
    `drafter=export` run of the same tree measures, its grafted_alone what a `drafter=prompt_lookup` run of the same
    chain length measures."""
    args = [f"checkpoint={exports['random']}", "num_prompts=3", "tree=auto", "tree.size=8"]
    report, profile = run_eval(args, tmp_path / "default", default_drafter=True)
    alone, _ = run_eval([*args, "drafter=export"], tmp_path / "alone")
    assert report["method"].startswith("hybrid/") and alone["method"] == "medusa/auto-8"
    assert report["greedy_match"] == 1.0 and report["drafter_alone"]["greedy_match"] == 1.0
    assert alone["drafter_alone"] is None and alone["grafted_alone"] is None  # nothing combined: nothing to compare
    mine = report["drafter_alone"]
    assert mine["tau"] == alone["tau"] and mine["accept_rate_per_position"] == alone["accept_rate_per_position"]
    chain = report["tree"]["grafted"]["depth"]
    lookup, _ = run_eval([f"checkpoint={exports['random']}", "num_prompts=3", "drafter=prompt_lookup",
                          f"drafter.num_tokens={chain}"], tmp_path / "lookup")
    grafted = report["grafted_alone"]
    assert grafted["greedy_match"] == 1.0 and grafted["tau"] == lookup["tau"] > mine["tau"]
    assert grafted["accept_rate_per_position"] == lookup["accept_rate_per_position"]
    assert grafted["speedup"] == pytest.approx(grafted["tokens_per_s"] / report["baseline_tokens_per_s"], rel=1e-2)
    # The tiny verifier repeats a token the prompt ends with, so lookup's chains are accepted where the random
    # heads' drafts are not: the combination emits more per round than its drafter alone.
    assert report["tau"] > mine["tau"] + 0.5
    assert mine["speedup"] == pytest.approx(mine["tokens_per_s"] / report["baseline_tokens_per_s"], rel=1e-2)
    assert set(profile["wall_s"]) >= {"speculative", "drafter_alone", "grafted_alone"}
    for group in [*report["by_category"].values(), *report["by_prompt_length"].values()]:
        for part in ("drafter_alone", "grafted_alone"):
            assert group[part]["greedy_match"] == 1.0 and group[part]["tau"] >= 1.0
    off, profile = run_eval([*args, "alone=false"], tmp_path / "off", default_drafter=True)
    assert off["method"] == report["method"] and off["drafter_alone"] is None and off["grafted_alone"] is None
    assert not {"drafter_alone", "grafted_alone"} & set(profile["wall_s"])


# Exactness on a verifier whose output varies, with the harness given objects.


@pytest.fixture(scope="module")
def varied() -> Verifier:
    return varied_llama()


class SelfOracle:
    """A drafter that computes the verifier's own greedy continuation and puts it down the last child at every
    depth (the other nodes get the next token id), so that accepted paths skip over tree nodes and the KV commit
    has to gather them."""

    feature_layers = (-1,)

    def __init__(self, verifier: Verifier, tree: Tree) -> None:
        self.model, self.vocab = verifier.model, verifier.vocab_size
        self.tree, self.max_nodes, self.max_depth = tree, tree.num_nodes, tree.max_depth

    def describe(self) -> dict:
        return {"policy": "self-oracle"}

    @torch.no_grad()
    def propose(self, input_ids, hidden) -> Draft:
        tree, seq = self.tree, input_ids
        for _ in range(tree.max_depth):
            seq = torch.cat([seq, self.model(seq).logits[:, -1:].argmax(-1)], dim=1)
        truth = seq[0, input_ids.shape[1]:].tolist()
        tokens = [input_ids[0, -1].item()] + [(t + 1) % self.vocab for t in truth[:1] * tree.num_drafts]
        node = 0
        for token in truth:
            children = [i for i, p in enumerate(tree.parents) if p == node]
            if not children:
                break
            node = children[-1]
            tokens[node] = token
        return Draft(tree=tree, tokens=torch.tensor([tokens]))

    def accepted(self, num_accepted, nodes) -> None:
        pass


def test_no_timed_loop_pays_the_engines_one_time_probe_of_a_prompts_length(varied, monkeypatch):
    # The engine probes attention's exactness once per cache length (0.56 s at 1,600 tokens on a 2-core machine);
    # plain decoding ran first on every prompt and paid it alone, which inflated every speedup on long prompts. The
    # runner runs the probe before it starts a clock: when each loop starts, the probe of its length is done.
    from eval.engine import forward as fast

    prompt, max_new = list(range(5, 5 + 377)), 8  # a length no other test decodes: not probed in this process yet
    probed = []

    def probed_now() -> bool:
        return any(key[3] >= len(prompt) + max_new + session.TREE_ROOM for key in fast._TRIM)

    def spy(loop):
        def timed_loop(*args, **kwargs):
            probed.append(probed_now())
            return loop(*args, **kwargs)
        return timed_loop

    assert not probed_now()
    monkeypatch.setattr("eval.runner.sample_decode", spy(decode.sample_decode))
    monkeypatch.setattr("eval.runner.speculative_decode", spy(decode.speculative_decode))
    drafter = random_heads_drafter(varied, auto_tree([[0.5, 0.7]] * 2, 4))
    runner = Runner(varied, drafter, max_new, lookup=3, engine="engine")  # auto: HF's forward in fp32 on a CPU
    runner.decode(prompt)
    assert probed == [True, True]  # plain, then speculative: neither pays the probe inside its clock


def run_objects(verifier: Verifier, drafter: Drafter, out: Path, num_prompts: int = 3) -> tuple[dict, dict]:
    """What `evaluate` runs once the verifier and drafter are loaded: every method on the eval split's first
    prompts, then report.json and profile.json."""
    runner = Runner(verifier, drafter, max_new_tokens=16, lookup=10)
    convs = select_prompts(load_conversations("builtin", split="eval"), num_prompts)
    samples = run_prompts(runner, convs, multi_turn=False, warmup=False, progress=False)
    meta = {"method": "test", "tree": drafter.describe(), "verifier": verifier.name, "checkpoint": "-"}
    report = write_outputs(samples, meta, {"max_new_tokens": 16}, {"speculative": drafter.max_depth}, out,
                           {"mode": "disabled"})
    return report, json.loads((out / "profile.json").read_text())


def random_heads_drafter(verifier: Verifier, tree: Tree) -> Drafter:
    heads = MedusaHeads(verifier.hidden_size, verifier.vocab_size, num_heads=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return make_drafter("medusa", verifier, tree, net=heads)


def off_by_one(cache, prefix_len, keep):
    """A wrong commit: the accepted entries gathered one position early (the last prefix entry is overwritten)."""
    COMMIT(cache, prefix_len - 1, keep)


def first_nodes(cache, prefix_len, keep):
    """A wrong commit: as many entries as accepted, but the tree's first nodes rather than the accepted path's."""
    COMMIT(cache, prefix_len, torch.arange(keep.shape[1])[None])


COMMIT = kv.commit
SCATTERED = from_medusa_choices([(0,), (1,), (2,), (2, 0), (2, 1), (2, 1, 0), (2, 1, 1), (2, 1, 1, 0)])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("drafter_name", ["random_heads", "oracle"])
def test_report_is_exact_on_a_varied_verifier_and_a_wrong_commit_shows(varied, tmp_path, monkeypatch, drafter_name):
    if drafter_name == "random_heads":
        drafter, wrong = random_heads_drafter(varied, auto_tree(ACCURACY, 8)), off_by_one
    else:
        drafter, wrong = SelfOracle(varied, SCATTERED), first_nodes
    report, profile = run_objects(varied, drafter, tmp_path / "ok")
    outputs = [p["new_tokens"]["baseline"] for p in profile["per_prompt"]]
    assert outputs == [16, 16, 16]
    assert report["greedy_match"] == 1.0 and set(profile["match_plain_greedy"].values()) == {1.0}
    assert report["tau"] > 3.0 if drafter_name == "oracle" else report["tau"] < 1.5
    # The same run with the KV commit broken: the harness must report the mismatch.
    monkeypatch.setattr(session.kv, "commit", wrong)
    broken, _ = run_objects(varied, drafter, tmp_path / "broken")
    assert broken["greedy_match"] < 1.0


def test_per_category_breakdown(exports, questions, tmp_path):
    report, profile = run_eval([f"checkpoint={exports['random']}", f"prompts={questions}", "num_prompts=null",
                                "tree=medusa_choices"], tmp_path)
    _check_sane(report, depth=4)
    assert sorted(report["by_category"]) == ["math", "writing"]
    assert [m["num_prompts"] for m in report["by_category"].values()] == [2, 2]
    assert sum(m["new_tokens"] for m in report["by_category"].values()) == report["new_tokens"]
    assert [p["turn"] for p in profile["per_prompt"]] == [1, 1, 1, 1]  # first turn only by default


def test_several_prompt_sets_are_reported_apart(exports, questions, tmp_path):
    """prompts=[a, b]: num_prompts from each set, categories "<set>/<category>", and one metrics block per set whose
    prompts and tokens add up to the whole run; a single set leaves by_prompt_set empty."""
    report, _ = run_eval([f"checkpoint={exports['random']}", f"prompts=[{questions},humaneval]", "num_prompts=2"],
                         tmp_path)
    sets = report["by_prompt_set"]
    assert list(sets) == [Path(questions).stem, "humaneval"] and [m["num_prompts"] for m in sets.values()] == [2, 2]
    assert sum(m["new_tokens"] for m in sets.values()) == report["new_tokens"]
    assert sets["humaneval"]["new_tokens"] == sum(m["new_tokens"] for c, m in report["by_category"].items()
                                                  if c.startswith("humaneval/"))
    assert all(m["greedy_match"] == 1.0 for m in sets.values())
    single, _ = run_eval([f"checkpoint={exports['random']}", "prompts=humaneval", "num_prompts=1"], tmp_path / "one")
    assert single["by_prompt_set"] == {}


def test_multi_turn_runs_every_turn_with_the_answers_as_history(exports, questions, tmp_path):
    report, profile = run_eval([f"checkpoint={exports['random']}", f"prompts={questions}", "multi_turn=true",
                                "num_prompts=2"], tmp_path)
    assert report["num_prompts"] == 4 and report["greedy_match"] == 1.0
    rows = profile["per_prompt"]
    assert [(r["id"], r["turn"]) for r in rows] == [("0", 1), ("0", 2), ("1", 1), ("1", 2)]
    for first, second in (rows[:2], rows[2:]):
        # Turn 2 sees turn 1, the verifier's answer to it, and the new question.
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["new_tokens"]["baseline"]


def test_humaneval_source_and_round_robin_selection():
    convs = load_conversations("humaneval")
    assert len(convs) == 164 and {c.category for c in convs} == {"humaneval"}
    assert convs[0].id == "HumanEval/0" and "def has_close_elements" in convs[0].user_turns[0]
    mixed = [Conversation(f"{c}{i}", c, [{"role": "user", "content": "x"}]) for c in "aab" for i in range(2)]
    assert [c.id for c in select_prompts(mixed, 3)] == ["a0", "b0", "a1"]


def _cli(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval", *args, f"output_dir={tmp_path / 'out'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_writes_report_and_an_offline_wandb_run(exports, tmp_path):
    proc = _cli([f"checkpoint={exports['random']}", "num_prompts=2", "max_new_tokens=8", "threads=1",
                 "wandb.mode=offline", "prompts=humaneval"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout and "where the time goes" in proc.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert list(report) == list(REPORT_KEYS) and list(report["by_category"]) == ["humaneval"]
    run_file = next((tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb"))
    inspect = subprocess.run(["wandb", "leet", "inspect", "--json", str(run_file)], capture_output=True, text=True,
                             timeout=120)
    records = [json.loads(line) for line in inspect.stdout.splitlines() if line.startswith("{")]
    logged = set().union(*[r["history"]["item"] for r in records if r.get("type") == "history"])
    assert {"eval/tau", "eval/speedup", "eval/alpha_1", "profile/speculative/verify_s", "eval/drafter_alone_tau",
            "eval/grafted_alone_tau",
            "plots/accept_length_hist.path", "eval/by_category.path"} <= logged


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


NOT_UTF8 = b'{"model_type": "medusa\xff\xfe"}'
BAD_INPUTS = {
    "mismatched verifier": (lambda e, d: [f"checkpoint={e}", "verifier_path={loader: tiny, seed: 1}"],
                            "different verifier"),
    "missing weights": (lambda e, d: [f"checkpoint={_strip(e, d, delete=True)}"], "model.safetensors is missing"),
    "corrupt weights": (lambda e, d: [f"checkpoint={_strip(e, d, delete=False)}"], "corrupt"),
    "EAGLE tree for Medusa": (lambda e, d: [f"checkpoint={e}", "tree=dynamic"], "does not fit a Medusa drafter"),
    "config.json not an object": (lambda e, d: [f"checkpoint={_edit(e, d, b'[1, 2]')}"], "not an object"),
    "config.json not UTF-8": (lambda e, d: ["checkpoint=" + str(_edit(e, d, NOT_UTF8))], "UTF-8"),
    "config.json without hidden_size": (lambda e, d: [f"checkpoint={_edit(e, d, drop='hidden_size')}"],
                                        "hidden_size is missing"),
    "export without fingerprint": (lambda e, d: [f"checkpoint={_edit(e, d, drop='verifier_fingerprint')}"],
                                   "has no verifier_fingerprint"),
    "num_prompts not a number": (lambda e, d: [f"checkpoint={e}", "num_prompts=abc"], "give a whole number"),
    "rank beyond the vocabulary": (lambda e, d: [f"checkpoint={e}", "tree=medusa_choices",
                                                 "tree.choices=[[0],[99999999]]"], "ranks below"),
    "rank not an integer": (lambda e, d: [f"checkpoint={e}", "tree=medusa_choices", "tree.choices=[[0],[a]]"],
                            "whole-number ranks"),
    "float16": (lambda e, d: [f"checkpoint={e}", "dtype=float16"], "not an evaluation dtype"),
    "max_new_tokens past the window": (lambda e, d: [f"checkpoint={e}", "max_new_tokens=100000"],
                                       "does not fit the verifier's context window of 2048"),
    "empty prompt file": (lambda e, d: [f"checkpoint={e}", f"prompts={_write(d / 'empty.jsonl', '')}"], "is empty"),
    "over-long prompt": (lambda e, d: [f"checkpoint={e}", "prompts=" + str(_write(
        d / "long.jsonl", json.dumps({"prompt": "word " * 2500}) + "\n"))], "context window of 2048"),
}


def _edit(export: Path, tmp: Path, config: bytes | None = None, drop: str | None = None) -> Path:
    """A copy of `export` whose config.json is `config` as raw bytes, or the original without the key `drop`."""
    copy = tmp / "export"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes((export / "model.safetensors").read_bytes())
    if drop is not None:
        cfg = json.loads((export / "config.json").read_text())
        del cfg[drop]
        config = json.dumps(cfg).encode()
    (copy / "config.json").write_bytes(config)
    return copy


def _strip(export: Path, tmp: Path, delete: bool) -> Path:
    """A copy of `export` without model.safetensors, or with it cut in half."""
    copy = tmp / "export"
    copy.mkdir()
    (copy / "config.json").write_text((export / "config.json").read_text())
    if not delete:
        data = (export / "model.safetensors").read_bytes()
        (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    return copy


def _in_process(args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[int, str]:
    """`python -m eval ARGS` as `python -m` runs it (runpy: eval/__main__.py as __main__, Hydra's command line, then
    exit_on_user_error) in this process: (exit status, what it wrote to stderr). The interpreter's start-up is the
    only part of the command line left out; test_bad_input_on_the_command_line runs one case as a real process."""
    import runpy

    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["eval", *args, f"output_dir={tmp_path / 'out'}"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("eval", run_name="__main__", alter_sys=True)
    return stopped.value.code, capsys.readouterr().err


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gives_one_clear_error(exports, tmp_path, case, monkeypatch, capsys):
    """Each bad input: exit status 2 and one `error:` line naming the problem, no traceback."""
    args, expected = BAD_INPUTS[case]
    code, err = _in_process([*args(exports["random"], tmp_path), "threads=1", "wandb.mode=disabled"], tmp_path,
                            monkeypatch, capsys)
    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], err[-3000:]


def test_bad_input_on_the_command_line(exports, tmp_path):
    """One bad input as a real `python -m eval` process: exit status 2, one `error:` line, no traceback."""
    args, expected = BAD_INPUTS["mismatched verifier"]
    proc = _cli([*args(exports["random"], tmp_path), "threads=1", "wandb.mode=disabled"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]


@pytest.mark.slow
def test_smoke_export_on_the_default_verifier_end_to_end(smoke_run, tmp_path):
    """`python train.py experiment=smoke` (run once for the test run: conftest.smoke_run), then `python -m eval` on
    its export from the command line: the report of an exact decode on the default verifier."""
    train, run = smoke_run
    assert train.returncode == 0, train.stderr[-3000:]
    proc = _cli([f"checkpoint={run / 'export'}", "prompts=builtin", "num_prompts=2", "max_new_tokens=16",
                 "threads=1", "wandb.mode=disabled"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert list(report) == list(REPORT_KEYS) and report["verifier"] == "SmolLM2-135M-Instruct"
    assert report["greedy_match"] == 1.0 and report["tau"] >= 1.0 and report["new_tokens"] > 0


@pytest.mark.usefixtures("one_thread")
def test_draft_model_run_measures_hf_assisted_generation(varied, tmp_path):
    """drafter=draft_model: HF assisted generation with the same draft model (constant num_assistant_tokens = its
    depth) joins the references in report.json; other drafters leave those keys null."""
    from eval.drafters.draft_model import make_draft_model_drafter
    from eval.engine.tree import Chain

    tiny_varied = "verifier_path={loader: tiny, seed: 1, layer_std: 0.3}"
    report, profile = run_eval(["drafter=draft_model", "drafter.layers=1", "drafter.depth=3", tiny_varied,
                                "num_prompts=2", "warmup=false"], tmp_path / "cli")
    for metrics in [report, *report["by_category"].values()]:
        assert metrics["hf_assisted_tokens_per_s"] > 0 and metrics["hf_assisted_greedy_match"] == 1.0
        assert metrics["hf_assisted_speedup"] == pytest.approx(
            metrics["hf_assisted_tokens_per_s"] / metrics["baseline_tokens_per_s"], rel=1e-2)
    assert profile["match_plain_greedy"]["hf_assisted"] == 1.0 and profile["wall_s"]["hf_assisted"] > 0
    other, _ = run_eval(["drafter=prompt_lookup", tiny_varied, "num_prompts=1", "warmup=false"], tmp_path / "other")
    assert other["hf_assisted_tokens_per_s"] is other["hf_assisted_greedy_match"] is None

    # The reference really drafts with our draft model, `depth` tokens a round: count its forwards and the verifier's.
    depth = 3
    drafter = make_draft_model_drafter(varied, Chain(depth), layers=1)
    calls = {"draft": 0, "verify": 0}
    hooks = [drafter.model.register_forward_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1)),
             varied.model.register_forward_hook(lambda *_: calls.__setitem__("verify", calls["verify"] + 1))]
    runner = Runner(varied, drafter, max_new_tokens=16, lookup=10, assistant=drafter.model, assistant_tokens=depth)
    ids = varied.tokenizer("Write a short poem about rivers and the sea.").input_ids
    try:
        x = torch.tensor([ids])
        out = runner._assisted(x)
    finally:
        for hook in hooks:
            hook.remove()
    assert out == runner.decode(ids).outputs["baseline"]
    # Each round: `depth` draft forwards (fewer only near max_new_tokens), then one verifier forward.
    assert (depth - 1) * calls["verify"] < calls["draft"] <= depth * calls["verify"], calls

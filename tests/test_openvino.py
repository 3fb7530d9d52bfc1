"""OpenVINO GenAI (PyPI openvino-genai 2026.4.1 with optimum-intel, its own virtualenv: scripts/setup_openvino.sh)
drafts with this toolkit's EAGLE-3 exports.

The shipped EAGLE-3 and a fresh one trained here (experiment=smoke) are converted (`convert openvino`: the verifier
and the drafter as OpenVINO IR, the feature layers in OpenVINO's convention in the draft IR's runtime info) and served
by OpenVINO's LLMPipeline with the draft. In f32 (OpenVINO's CPU runs it, so its greedy trajectory is the verifier's
up to kernel rounding) the speculative output equals OpenVINO's own plain output, and the drafts accepted per round
equal our decoder's on the same prompts and chains within the tolerance the test derives. What OpenVINO reads back
from a converted folder is checked against the export (check_contract): a draft IR with the feature layers written
in our convention (the ids unshifted, what OpenVINO also takes by default on this verifier) is refused.

Without the OpenVINO virtualenv the engine tests skip, except in CI (CI=true) or under SPECDRAFT_REQUIRE_OPENVINO=1,
where they fail; the refusals made before the engine is asked run everywhere.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compose_train, run_shared
from runtime.errors import UserError

pytestmark = pytest.mark.slow

ENGINE = pytest.mark.engine
SHIPPED = ROOT / "pretrained" / "eagle3-smollm2"
K = 3
PROMPTS = 4
MAX_NEW = 48


@pytest.fixture(scope="session")
def prompts(smollm2):
    from data.chat import prompt_ids
    from data.prompts import load_conversations

    convs = load_conversations("builtin", split="eval", limit=PROMPTS)
    return [prompt_ids(smollm2.tokenizer, [{"role": "user", "content": c.user_turns[0]}]) for c in convs]


@pytest.fixture(scope="session")
def verifier_ir(openvino, smollm2, tmp_path_factory, cache_dir):
    """The default verifier as OpenVINO IR, converted once per checkout (<cache>/openvino/verifiers)."""
    with run_shared(tmp_path_factory, "openvino-verifier"):
        return openvino.converted_verifier(smollm2.checkpoint, cache_dir)


@pytest.fixture(scope="session")
def shipped(openvino, smollm2, verifier_ir, tmp_path_factory):
    """The shipped EAGLE-3 converted for OpenVINO GenAI in this test run (its verifier IR linked from the cache)."""
    with run_shared(tmp_path_factory, "openvino-shipped") as root:
        if not (root / "ov" / openvino.MANIFEST).is_file():
            openvino.convert(SHIPPED, root / "ov", smollm2.checkpoint, verifier_ir=verifier_ir)
        return root / "ov"


def _ours(verifier, export: Path, prompts: list[list[int]], k: int = K) -> tuple[list[list[int]], torch.Tensor]:
    """Our decoder's outputs and drafts accepted per round, drafting chains of k from the export."""
    from eval.drafters.build import make_drafter
    from eval.engine.decode import speculative_decode
    from eval.engine.tree import Chain

    drafter = make_drafter("eagle3", verifier, Chain(k), checkpoint=export)
    outs, lengths = [], []
    for ids in prompts:
        res = speculative_decode(verifier, drafter, torch.tensor([ids]), MAX_NEW,
                                 eos_token_id=verifier.tokenizer.eos_token_id)
        outs.append(res.tokens[0].tolist())
        lengths.append(res.accept_lengths[:, 0])
    return outs, torch.cat(lengths).float()


def _tolerance(per_round: torch.Tensor, n_theirs: int, k: int = K) -> float:
    """How far two means of drafts accepted per round (0..k each) may lie apart when both decoders draft the same
    chains on the same prompts: four standard errors of the difference (the spread of ours, at least that of a
    0.05 / 0.95 coin, so a tiny sample still allows a flipped near-tie), plus one round's full weight in each."""
    n = per_round.numel()
    var = max(float(per_round.var()) if n > 1 else 0.0, 0.05 * 0.95)
    return 4 * math.sqrt(var * (1 / n + 1 / n_theirs)) + k / n + k / n_theirs


@ENGINE
def test_shipped_eagle3_drafts_in_openvino_as_ours(openvino, shipped, smollm2, prompts):
    """The shipped EAGLE-3, converted: OpenVINO GenAI reads its feature layers in its own convention (one below
    ours) from the draft IR, drafts chains of 3, and in f32 its output is its plain output and the drafts it accepts
    per round are ours within the tolerance (measured: 0.56 theirs, 0.60 ours on these 4 prompts)."""
    manifest = json.loads((shipped / openvino.MANIFEST).read_text())
    assert manifest["feature_layers"] == [2, 15, 27] and manifest["hidden_layers_list"] == [1, 14, 26]
    configs = [openvino.configuration("plain"), openvino.configuration("eagle3", shipped / "draft", K)]
    runs = openvino.serve_many(shipped / "verifier", prompts, MAX_NEW, configs, precision="f32", threads=2)
    plain, spec = runs["plain"], runs["eagle3"]
    assert spec.outputs == plain.outputs  # f32 greedy: drafting changes the speed, never the text
    assert spec.rounds and spec.draft_tokens and spec.tau is not None and spec.tau > 1
    ours_out, ours = _ours(smollm2, SHIPPED, prompts)
    theirs = spec.accepted_per_round
    assert theirs is not None and theirs > 0.3, spec  # a drafter that drafts nothing fails here
    tol = _tolerance(ours, spec.rounds)
    assert abs(theirs - float(ours.mean())) <= tol, (theirs, float(ours.mean()), tol)
    assert sum(a == b for a, b in zip(plain.outputs, ours_out)) >= PROMPTS // 2  # fp32: the same greedy answers


@ENGINE
def test_feature_layers_in_our_convention_are_refused(openvino, shipped, tmp_path):
    """The contract read back: a draft IR whose hidden_layers_list holds our ids unshifted (layer inputs, what
    OpenVINO also takes by default here) is refused, naming both conventions and the fix; the right ids pass."""
    broken = tmp_path / "ov"
    shutil.copytree(shipped, broken, copy_function=openvino._link)
    openvino.check_contract(broken, SHIPPED)  # as converted
    openvino.set_feature_layers(broken / "draft", [2, 15, 27])
    with pytest.raises(UserError, match=r"hidden_layers_list is \[2, 15, 27\].*\[1, 14, 26\] in OpenVINO's conv"):
        openvino.check_contract(broken, SHIPPED)
    openvino.check_contract(shipped, SHIPPED)  # the linked original kept its own


@ENGINE
def test_fresh_eagle3_converts_and_drafts(openvino, train_script, tmp_path, smollm2, prompts, verifier_ir):
    """An EAGLE-3 trained here (experiment=smoke) -> `python -m scripts.tools.convert openvino` (the real command
    line) -> OpenVINO GenAI drafts with it: its feature layers shifted into OpenVINO's convention, its output in f32
    its plain output."""
    export = train_script.run(compose_train(["model=eagle3", "experiment=smoke", "logger=csv"], tmp_path / "run"))
    ids = json.loads((Path(export) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    out = tmp_path / "ov"
    proc = subprocess.run([sys.executable, "-m", "scripts.tools.convert", "openvino", str(export), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / openvino.MANIFEST).read_text())["hidden_layers_list"] == [i - 1 for i in ids]
    runs = openvino.serve_many(out / "verifier", prompts[:2], 24,
                               [openvino.configuration("plain"), openvino.configuration("eagle3", out / "draft", K)],
                               precision="f32", threads=2)
    assert runs["eagle3"].outputs == runs["plain"].outputs
    assert runs["eagle3"].draft_tokens and runs["eagle3"].tau is not None and runs["eagle3"].tau >= 1


@ENGINE
def test_python_m_eval_runs_openvino_as_a_peer(openvino, verifier_ir, tmp_path):
    """`python -m eval checkpoint=pretrained/eagle3-smollm2 engine_peers=[openvino]`: report.json holds OpenVINO
    plain, drafting with the export and its own prompt lookup on the run's prompts: tokens/s, tau, accepted per
    round, speedups over OpenVINO's plain and greedy agreement with it and with ours."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    out = tmp_path / "eval"
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            f"checkpoint={SHIPPED}", "drafter=export", "engine_peers=[openvino]", "engine_peer_tokens=3", "tree=chain",
            "tree.depth=3", "dtype=float32", "threads=2", "max_new_tokens=16", "num_prompts=2", "warmup=false",
            "wandb.mode=disabled", f"output_dir={out}"])
    report = evaluate(cfg, progress=False)
    peer = json.loads((out / "report.json").read_text())["engine_peers"]["openvino"]
    assert peer == json.loads(json.dumps(report["engine_peers"]["openvino"]))
    assert peer["version"].startswith(openvino.VERSION) and peer["setup"]["precision"] == "f32"
    assert peer["plain"]["tokens"] > 0 and peer["plain"]["tokens_per_s"] > 0
    spec, lookup = peer["speculative"], peer["prompt_lookup"]
    assert spec["method"] == "eagle3" and spec["speculative_tokens"] == 3
    assert spec["tau"] >= 1 and spec["counts"]["rounds"] > 0 and spec["counts"]["draft_tokens"] > 0
    assert spec["greedy_match_plain"] == 1.0 and lookup["greedy_match_plain"] == 1.0  # f32 greedy
    assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / peer["plain"]["tokens_per_s"])
    assert lookup["tokens"] == peer["plain"]["tokens"]
    assert peer["greedy_match_ours"] >= 0.5


# ------------------------------------------------------------------ refusals (before the engine is asked: no venv)


def _convert(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scripts.tools.convert", "openvino", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_a_family_openvino_lacks_is_refused(tmp_path):
    proc = _convert(str(ROOT / "pretrained" / "medusa-smollm2"), str(tmp_path / "ov"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: OpenVINO GenAI") and "does not draft with medusa" in proc.stderr
    assert "engine_peers=[vllm]" in proc.stderr and not (tmp_path / "ov").exists()


def test_a_missing_verifier_folder_is_refused(tmp_path):
    proc = _convert(str(SHIPPED), str(tmp_path / "ov"), "--verifier", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no config.json there" in proc.stderr and "--verifier" in proc.stderr


def test_norms_openvino_lacks_are_refused(tmp_path):
    """EAGLE-3.1's fc_norm: OpenVINO's draft layer has none, so the export is refused before converting."""
    from serve.openvino_engine import convert

    export = tmp_path / "export"
    shutil.copytree(SHIPPED, export)
    config = json.loads((export / "config.json").read_text())
    config["fc_norm"] = True
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="fc_norm=true.*OpenVINO's EAGLE-3 draft layer"):
        convert(export, tmp_path / "ov", "unused")


def test_feature_layer_ids_openvino_cannot_take():
    from serve.openvino_engine import openvino_layers

    assert openvino_layers([2, 15, 27], 30) == [1, 14, 26]
    with pytest.raises(UserError, match="0 is the embeddings"):
        openvino_layers([0, 15, 27], 30)
    with pytest.raises(UserError, match="exactly three"):
        openvino_layers([2, 15], 30)


def test_a_missing_virtualenv_names_the_setup_script(monkeypatch, tmp_path):
    from serve import openvino_engine

    monkeypatch.setenv("SPECDRAFT_OPENVINO_VENV", str(tmp_path / "none"))
    with pytest.raises(UserError, match="scripts/setup_openvino.sh"):
        openvino_engine.openvino_python()


def test_openvino_peer_under_load_is_refused():
    from eval.serving import settings

    with pytest.raises(UserError, match=r"the load sweep runs in one engine, vLLM's server or llama.cpp's"):
        settings(["openvino"], None, [1, 2], None, False, "single", str(SHIPPED))


def test_peers_are_named_once_each_engine():
    """engine_peers=[vllm,openvino] runs both at batch 1; an engine the harness does not drive is refused, naming
    the ones it does."""
    from eval.serving import settings

    assert settings(["vllm", "openvino"], 3, None, None, False, "single", str(SHIPPED)).peers == ("vllm", "openvino")
    with pytest.raises(UserError, match=r"\['sglang'\] unknown.*\['vllm', 'openvino', 'llamacpp'\]"):
        settings(["openvino", "sglang"], None, None, None, False, "single", str(SHIPPED))

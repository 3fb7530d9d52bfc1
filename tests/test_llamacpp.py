"""The real llama.cpp (llama-server b11434, built by scripts/setup_llamacpp.sh) serves this toolkit's exports.

The shipped EAGLE-3 and DFlash (pretrained/), and an EAGLE-3 trained here with a short recipe, are converted to GGUF
by `convert gguf` (llama.cpp's own converter; DFlash through z-lab's flat layout), their metadata checked against the
export, then served by llama-server: each drafts (llama.cpp's own counters say so), its first-position acceptance on
the same prompts equals our decoder's within the tolerance tests/test_engine_vllm.py derives (an f32 verifier on
both sides, greedy), and its output equals llama.cpp's own plain output. Families llama.cpp lacks, a missing
verifier folder and a GGUF whose feature layers are shifted are refused with the fix named.

Without llama.cpp these tests skip, except in CI (CI=true) or under SPECDRAFT_REQUIRE_LLAMACPP=1, where they fail.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compose_train, run_shared

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_NEW = 48
PROMPTS = 4
THREADS = 2
RECIPE = ["data.limit=32", "data.max_new_tokens=64", "data.gen_batch_size=16", "data.batch_size=4",
          "data.val_fraction=0.1", "data.cache_hidden_states=true", "trainer.max_steps=24", "trainer.max_epochs=20",
          "logger=csv"]


def _convert(tmp_path_factory, name: str, export: Path, quants: str) -> Path:
    """`convert gguf EXPORT` once per test run (whichever xdist worker asks first)."""
    from serve.gguf import MANIFEST, convert

    with run_shared(tmp_path_factory, f"gguf-{name}") as root:
        out = root / "gguf"
        if not (out / MANIFEST).is_file():
            convert(export, out, quants.split(","), force=True)
        return out


@pytest.fixture(scope="session")
def eagle3_gguf(llamacpp, tmp_path_factory):
    return _convert(tmp_path_factory, "eagle3", ROOT / "pretrained" / "eagle3-smollm2", "f32")


@pytest.fixture(scope="session")
def dflash_gguf(llamacpp, tmp_path_factory):
    return _convert(tmp_path_factory, "dflash", ROOT / "pretrained" / "dflash-smollm2", "f32")


@pytest.fixture(scope="session")
def prompts(smollm2):
    from data.chat import prompt_ids
    from data.prompts import load_conversations

    convs = load_conversations("builtin", split="eval", limit=PROMPTS)
    return [prompt_ids(smollm2.tokenizer, [{"role": "user", "content": c.user_turns[0]}]) for c in convs]


def _ours(verifier, kind: str, export: Path, prompts, k: int) -> tuple[list[list[int]], list[float], int]:
    """Our decoder's outputs, alpha_1..k and rounds, drafting chains of k from the export."""
    from eval.drafters.build import make_drafter
    from eval.engine.decode import speculative_decode
    from eval.engine.tree import Chain

    drafter = make_drafter(kind, verifier, Chain(k), checkpoint=export)
    outs, lengths = [], []
    for ids in prompts:
        res = speculative_decode(verifier, drafter, torch.tensor([ids]), MAX_NEW,
                                 eos_token_id=verifier.tokenizer.eos_token_id)
        outs.append(res.tokens[0].tolist())
        lengths.append(res.accept_lengths[:, 0])
    flat = torch.cat(lengths)
    return outs, [float((flat >= j).float().mean()) for j in range(1, k + 1)], int(flat.numel())


def _tolerance(p: float, n_ours: int, n_theirs: int) -> float:
    """tests/test_engine_vllm.py's: four standard errors of the difference of two binomial rates at the pooled rate
    (at least that of p = 0.05), plus one round's weight on each side."""
    q = min(max(p, 0.05), 0.95)
    return 4 * math.sqrt(q * (1 - q) * (1 / n_ours + 1 / n_theirs)) + 1 / n_ours + 1 / n_theirs


def _served(folder: Path, llamacpp, prompts, k: int, plain: bool = False, quant: str = "f32"):
    manifest = json.loads((folder / "llamacpp.json").read_text())
    model = folder / manifest["verifier"]["files"][quant]
    if plain:
        return llamacpp.serve(model, prompts, MAX_NEW, threads=THREADS)
    return llamacpp.serve(model, prompts, MAX_NEW, draft=folder / manifest["draft"], kind=manifest["kind"],
                          tokens=k, p_min=0.0, threads=THREADS)


def _same_acceptance(ours_alpha: list[float], n_ours: int, run) -> None:
    assert run.steps > 0 and run.accepted > 0 and run.drafted > 0, (run.steps, run.accepted, run.drafted)
    a, b = ours_alpha[0], run.alpha[0]
    tol = _tolerance((a + b) / 2, n_ours, run.steps)
    assert abs(a - b) <= tol, f"alpha_1: ours {a:.3f} llama.cpp {b:.3f}, tolerance {tol:.3f} ({n_ours} / " \
                              f"{run.steps} rounds)"


def test_shipped_eagle3_drafts_in_llamacpp_as_in_ours(eagle3_gguf, llamacpp, smollm2, prompts, tmp_path):
    """The shipped EAGLE-3, converted: llama.cpp drafts with it, accepts at its first position what our decoder
    accepts (same prompts, f32 verifier, greedy, K=3), and its output is llama.cpp's own plain output."""
    from models.exports.shipped import engine_ready

    manifest = json.loads((eagle3_gguf / "llamacpp.json").read_text())
    assert manifest["kind"] == "eagle3" and manifest["contract"]["eagle3.target_layers"] == [2, 15, 27]
    spec = _served(eagle3_gguf, llamacpp, prompts, 3)
    plain = _served(eagle3_gguf, llamacpp, prompts, 3, plain=True)
    assert plain.steps == 0 and plain.drafted == 0
    assert spec.outputs == plain.outputs  # exact: greedy on an f32 verifier
    assert len(spec.alpha) == 3 and spec.tau is not None and spec.tau > 1.2, (spec.alpha, spec.tau)
    export = engine_ready(ROOT / "pretrained" / "eagle3-smollm2", tmp_path / "served", smollm2)
    _, alpha, n = _ours(smollm2, "eagle3", export, prompts, 3)
    _same_acceptance(alpha, n, spec)


def test_shipped_dflash_drafts_in_llamacpp_as_in_ours(dflash_gguf, llamacpp, smollm2, prompts, tmp_path):
    """The shipped DFlash, flattened to z-lab's layout with its layer ids counted as outputs (ours - 1): llama.cpp
    extracts the features it was trained on (GGUF target_layers = ours) and accepts at its first position what our
    decoder accepts (a block of 8: 7 drafts)."""
    from models.exports.shipped import engine_ready

    manifest = json.loads((dflash_gguf / "llamacpp.json").read_text())
    assert manifest["contract"]["dflash.target_layers"] == [2, 15, 27]
    assert manifest["contract"]["dflash.block_size"] == 8
    spec = _served(dflash_gguf, llamacpp, prompts, 7)
    export = engine_ready(ROOT / "pretrained" / "dflash-smollm2", tmp_path / "served", smollm2)
    _, alpha, n = _ours(smollm2, "dflash", export, prompts, 7)
    _same_acceptance(alpha, n, spec)


@pytest.fixture(scope="session")
def fresh(llamacpp, train_script, tmp_path_factory, smollm2):
    """family -> (export, converted folder): a drafter trained here on the default verifier with a short recipe
    (train.py's export, f32 weights: an f32 draft GGUF), converted; once per test run."""
    def make(kind: str) -> tuple[Path, Path]:
        with run_shared(tmp_path_factory, f"llamacpp-fresh-{kind}") as root:
            done = root / "export.path"
            if not done.is_file():
                export = train_script.run(compose_train([f"model={kind}", *RECIPE], root / "run"))
                done.write_text(str(export))
            export = Path(done.read_text())
        return export, _convert(tmp_path_factory, f"fresh-{kind}", export, "f32")

    return make


@pytest.mark.parametrize(("kind", "k"), [("eagle3", 3), ("dspark", 7)])
def test_fresh_export_converts_and_drafts(fresh, llamacpp, smollm2, prompts, kind, k):
    """An EAGLE-3 and a DSpark train.py just exported (speculators layout) convert, pass the contract check, serve
    and draft, their first-position acceptance our decoder's (DSpark: a block of 8, its Markov head, 7 drafts)."""
    export, folder = fresh(kind)
    manifest = json.loads((folder / "llamacpp.json").read_text())
    assert manifest["draft"] == f"draft-{kind}.gguf" and manifest["kind"] == kind
    assert manifest["contract"]["general.architecture"] in ("eagle3", "dflash")
    spec = _served(folder, llamacpp, prompts[:2], k)
    _, alpha, n = _ours(smollm2, kind, export, prompts[:2], k)
    _same_acceptance(alpha, n, spec)


def test_contract_refuses_shifted_feature_layers(llamacpp, smollm2, tmp_path):
    """The DFlash flattened by hand with our ids as z-lab's (inputs taken for outputs: the 0.04 acceptance) and an
    EAGLE-3 whose ids were shifted: the GGUF's target_layers are one off, and the check refuses each, naming it.
    The converter's own flattening passes the same check."""
    from models.exports.io import read_config
    from models.exports.shipped import engine_ready
    from runtime.errors import UserError
    from serve.gguf import check_contract, expected_contract, flat_layout

    dflash = engine_ready(ROOT / "pretrained" / "dflash-smollm2", tmp_path / "dflash", smollm2)
    want = expected_contract(read_config(dflash), "dflash")
    flat = flat_layout(dflash, tmp_path / "flat")
    right = llamacpp.convert_hf(flat, tmp_path / "right.gguf", "bf16", target_dir=smollm2.checkpoint)
    assert check_contract(right, want)["dflash.target_layers"] == [2, 15, 27]
    config = json.loads((flat / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [2, 15, 27]  # ours as they are: read as outputs by llama.cpp
    (flat / "config.json").write_text(json.dumps(config))
    wrong = llamacpp.convert_hf(flat, tmp_path / "wrong.gguf", "bf16", target_dir=smollm2.checkpoint)
    with pytest.raises(UserError, match=r"target_layers: the GGUF says \[3, 16, 28\], the export \[2, 15, 27\] "
                                        r"\(every id off by \+1"):
        check_contract(wrong, want)

    eagle = engine_ready(ROOT / "pretrained" / "eagle3-smollm2", tmp_path / "eagle", smollm2)
    want = expected_contract(read_config(eagle), "eagle3")
    config = json.loads((eagle / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 14, 26]
    (eagle / "config.json").write_text(json.dumps(config))
    shifted = llamacpp.convert_hf(eagle, tmp_path / "eagle.gguf", "bf16", target_dir=smollm2.checkpoint)
    with pytest.raises(UserError, match=r"eagle3.target_layers: .* \(every id off by -1"):
        check_contract(shifted, want)


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("export", ["medusa-smollm2"])
def test_families_llamacpp_lacks_are_refused(llamacpp, export, tmp_path):
    """A Medusa export: `convert gguf` and `serve --engine llamacpp` say llama.cpp has no such drafter and what to
    use instead, before anything loads, and write nothing."""
    out = tmp_path / "out"
    for argv in (["-m", "scripts.tools.convert", "gguf", f"pretrained/{export}", str(out)],
                 ["-m", "serve", f"pretrained/{export}", "--engine", "llamacpp", "--port", "1"]):
        proc = _cli(*argv, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "llama.cpp (b11434) has no Medusa drafter" in proc.stderr and "python -m serve EXPORT" in proc.stderr
        assert "--plain" in proc.stderr
    assert not out.exists()


def test_bad_input_is_refused(llamacpp, tmp_path, smollm2):
    """A verifier folder that is not there, options llama.cpp has no use for, and vLLM given llama.cpp's options."""
    from models.exports.shipped import engine_ready

    export = engine_ready(ROOT / "pretrained" / "eagle3-smollm2", tmp_path / "export", smollm2)
    config = json.loads((export / "config.json").read_text())
    config["verifier"] = {"loader": "hf", "path": str(tmp_path / "no-such-verifier")}
    config.pop("verifier_path", None)
    (export / "config.json").write_text(json.dumps(config))
    proc = _cli("-m", "scripts.tools.convert", "gguf", str(export), str(tmp_path / "out"), timeout=300)
    assert proc.returncode == 2 and "no-such-verifier" in proc.stderr, proc.stderr
    for argv, said in ((["--schedule", "1-4:3"], "--schedule is not available with --engine llamacpp"),
                       (["--record", str(tmp_path / "r")], "--record is not available with --engine llamacpp"),
                       (["--plain", "--tokens", "2"], "--plain serves the verifier alone"),
                       (["--quant", "q3"], "--quant 'q3'")):
        proc = _cli("-m", "serve", "pretrained/eagle3-smollm2", "--engine", "llamacpp", *argv, timeout=120)
        assert proc.returncode == 2 and said in proc.stderr, (argv, proc.stderr)
    proc = _cli("-m", "serve", "pretrained/eagle3-smollm2", "--p-min", "0.5", timeout=120)
    assert proc.returncode == 2 and "--p-min is llama.cpp's" in proc.stderr, proc.stderr


def test_serve_command_llamacpp(eagle3_gguf, llamacpp, prompts):
    """`python -m serve FOLDER --engine llamacpp`: loopback, the OpenAI routes (/v1/models, /v1/completions with
    token-id prompts), the folder's launch.json read (K=3, p-min 0.6 from the conversion), and llama-server's whole
    group down on SIGTERM."""
    import httpx

    port = llamacpp.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve", str(eagle3_gguf), "--engine", "llamacpp", "--quant", "f32",
                             "--port", str(port), "--threads", str(THREADS)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "ready at" in line or proc.poll() is not None:
                break
        out = "".join(lines)
        assert f"ready at http://127.0.0.1:{port}/v1" in out, out
        assert "K=3, p-min 0.6" in out, out
        url = f"http://127.0.0.1:{port}/v1"
        assert httpx.get(f"{url}/models").json()["data"][0]["id"] == eagle3_gguf.name
        answer = httpx.post(f"{url}/completions", json={"model": eagle3_gguf.name, "prompt": prompts[0],
                                                         "max_tokens": 16, "temperature": 0}, timeout=300).json()
        assert answer["usage"]["completion_tokens"] == 16 and answer["choices"][0]["text"], answer
        group = proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(ProcessLookupError):
            for _ in range(100):
                os.killpg(group, 0)
                time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_python_m_eval_runs_llamacpp_as_a_peer(llamacpp, tmp_path):
    """`python -m eval checkpoint=pretrained/eagle3-smollm2 engine_peers=[llamacpp]`: report.json holds llama.cpp
    plain (measured first and last) and drafting at each K up to engine_peer_tokens and each confidence cut, with
    llama.cpp's acceptance per position, speedups over its plain and greedy agreement (f32: every drafting output is
    its plain output); the fastest configuration is written to the conversion's launch.json, which `python -m serve
    EXPORT --engine llamacpp` then launches with."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate
    from eval.serving.peers import CUTS

    out = tmp_path / "eval"
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            f"checkpoint={ROOT / 'pretrained' / 'eagle3-smollm2'}", "drafter=export", "engine_peers=[llamacpp]",
            "engine_peer_tokens=2", "tree=chain", "tree.depth=2", "dtype=float32", f"threads={THREADS}",
            "max_new_tokens=16", "num_prompts=2", "warmup=false", "wandb.mode=disabled", f"output_dir={out}"])
    report = evaluate(cfg, progress=False)
    peer = json.loads((out / "report.json").read_text())["engine_peers"]["llamacpp"]
    assert peer == json.loads(json.dumps(report["engine_peers"]["llamacpp"]))
    assert peer["quant"] == "f32" and peer["plain"]["tokens"] > 0 and peer["plain"]["drift"] > 0
    rows = peer["configurations"]
    assert [(r["speculative_tokens"], r["p_min"]) for r in rows] == [(k, c) for k in (1, 2) for c in CUTS]
    for r in rows:
        assert r["method"] == "eagle3" and r["greedy_match_plain"] == 1.0, r  # f32 greedy: exact in llama.cpp
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / peer["plain"]["tokens_per_s"])
        assert len(r["accept_rate_per_position"]) == r["speculative_tokens"]
    assert all(r["counts"]["steps"] > 0 and r["counts"]["accepted"] > 0 for r in rows if r["p_min"] == 0)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    assert peer["speculative"] == best
    launch = json.loads(Path(peer["launch"]).read_text())
    assert (launch["tokens"], launch["p_min"]) == (best["speculative_tokens"], best["p_min"])
    assert peer["greedy_match_ours"] >= 0.5
    served = subprocess.run([sys.executable, "-m", "serve", str(ROOT / "pretrained" / "eagle3-smollm2"), "--engine",
                             "llamacpp", "--quant", "f32", "--print-command"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert served.returncode == 0, served.stderr
    assert f"--spec-draft-n-max {best['speculative_tokens']} --spec-draft-p-min {best['p_min']}" in served.stdout


def test_python_m_eval_sweeps_llamacpp_by_concurrency(llamacpp, tmp_path):
    """`engine_peers=[llamacpp] engine_concurrency=[1,2]`: the batch-1 peer, then llama.cpp plain and its fastest
    drafting setting on a server with that many slots and as many closed-loop clients, per concurrency."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    out = tmp_path / "eval"
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            f"checkpoint={ROOT / 'pretrained' / 'eagle3-smollm2'}", "drafter=export", "engine_peers=[llamacpp]",
            "engine_concurrency=[1,2]", "engine_peer_tokens=1", "tree=chain", "tree.depth=1", "dtype=float32",
            f"threads={THREADS}", "max_new_tokens=16", "num_prompts=2", "warmup=false", "wandb.mode=disabled",
            f"output_dir={out}"])
    evaluate(cfg, progress=False)
    peer = json.loads((out / "report.json").read_text())["engine_peers"]["llamacpp"]
    best = peer["speculative"]
    assert [(r["speculative_tokens"], r["p_min"]) for r in peer["configurations"]] == [(1, 0.0), (1, 0.6)]
    rows = peer["by_concurrency"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["slots"] == r["concurrency"] and r["plain_tokens_per_s"] > 0 and r["speculative_tokens_per_s"] > 0
        assert (r["speculative_tokens"], r["p_min"]) == (best["speculative_tokens"], best["p_min"])
        assert r["speedup"] == pytest.approx(r["speculative_tokens_per_s"] / r["plain_tokens_per_s"])
        assert r["drafted"] > 0


def test_llamacpp_sweep_settings_are_refused_at_the_door():
    """The llama.cpp sweep runs alone and over one K; vLLM's length groups are vLLM's."""
    from eval.serving import settings
    from runtime.errors import UserError

    export = str(ROOT / "pretrained" / "eagle3-smollm2")
    assert settings(["llamacpp"], 2, [1, 2], None, False, "single", export).load.concurrency == (1, 2)
    with pytest.raises(UserError, match="one engine"):
        settings(["llamacpp", "vllm"], None, [1, 2], None, False, "single", export)
    with pytest.raises(UserError, match="give one K"):
        settings(["llamacpp"], [1, 2], [1, 2], None, False, "single", export)

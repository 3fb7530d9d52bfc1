"""Serving an export under load (issue 67): `python -m serve EXPORT` starts vLLM's OpenAI-compatible server with the
project's CPU settings; `python -m eval ... engine_peers=[vllm] engine_concurrency=[...]` sweeps concurrency x K
through it, writes the K per batch size as vLLM's num_speculative_tokens_per_batch_size and measures it; the batch
cost model predicts the best K and the crossover beside it.

The engine tests start the real server on loopback with the shipped EAGLE-3 export (no training) and send real
requests; without the vLLM virtualenv they skip (CI=true or SPECDRAFT_REQUIRE_VLLM=1: they fail). No test asserts
a speed: the figures are in docs/results/serving-under-load.md.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import ROOT, count_reads

EAGLE3 = ROOT / "pretrained" / "eagle3-smollm2"
MEDUSA = ROOT / "pretrained" / "medusa-smollm2"


def _eval_cfg(overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="eval", overrides=["wandb.mode=disabled", "warmup=false", *overrides])


# -- bad input: one message each, before anything loads -------------------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    (["engine_peers=[vllm]", "engine_concurrency=[0,2]"], "0 is not a number of clients"),
    (["engine_peers=[vllm]", "engine_concurrency=[1,-4]"], "-4 is not a number of clients"),
    (["engine_concurrency=[1,2]"], "without engine_peers"),
    ([f"checkpoint={MEDUSA}", "engine_peers=[vllm]", "engine_concurrency=[1,2]", "engine_peer_tokens=[1,5]"],
     "K=5 is beyond what"),
    ([f"checkpoint={MEDUSA}", "engine_peers=[vllm]", "engine_peer_tokens=[1,2]"], "a list of K is swept under load"),
    (["engine_peers=[vllm]", "engine_concurrency=[1,2]", "engine_prompt_lengths=[short,medium]"],
     "unknown group 'medium'; the groups are short (1-511 tokens), long (512+ tokens)"),
    (["engine_peers=[vllm]", "engine_concurrency=[1,2]", "engine_prompt_lengths=[short,long:0]"],
     "'long:0' asks for '0' prompts"),
    (["engine_peers=[vllm]", "engine_concurrency=[1,2]", "engine_prompt_lengths=[long,long:8]"], "named twice"),
    (["engine_peers=[vllm]", "engine_prompt_lengths=[short,long]"], "add engine_concurrency=[1,2,4,8,16]"),
])
def test_bad_load_settings_are_one_message_before_anything_loads(overrides, words, tmp_path):
    """A verifier that does not exist is named too: the message must come before it would be loaded."""
    from eval.harness import evaluate
    from runtime.errors import UserError

    base = [f"checkpoint={EAGLE3}", f"verifier_path={tmp_path / 'no-such-verifier'}", f"output_dir={tmp_path}"]
    cfg = _eval_cfg(base + overrides)
    with pytest.raises(UserError) as e:
        evaluate(cfg, progress=False)
    assert words in str(e.value) and "no-such-verifier" not in str(e.value)
    assert not (tmp_path / "report.json").exists()


def test_python_m_serve_refuses_bad_settings_before_loading(capsys):
    from serve.cli import main

    assert main([str(MEDUSA), "--tokens", "5", "--print-command"]) == 2
    err = capsys.readouterr().err
    assert "K=5 is beyond what" in err and "4 tokens a step" in err
    assert main([str(EAGLE3), "--schedule", "2-4:3", "--print-command"]) == 2
    assert "start it at 1" in capsys.readouterr().err
    assert main([str(EAGLE3), "--schedule", "1-4:3,3-8:1", "--print-command"]) == 2
    assert "overlaps" in capsys.readouterr().err
    assert main([str(EAGLE3), "--tokens", "2", "--schedule", "1-4:3", "--print-command"]) == 2
    assert "both given" in capsys.readouterr().err


@pytest.mark.slow
def test_convert_engine_ready_records_the_schedule_and_python_m_serve_launches_with_it(tmp_path, capsys):
    from scripts.tools.convert import main as convert
    from serve.cli import main as serve

    out = tmp_path / "served"
    assert convert(["engine-ready", str(EAGLE3), str(out), "--schedule", "1-1:5,2-2:2,3-16:0"]) == 0
    assert f"launch: python -m serve {out} --schedule 1-1:5,2-2:2,3-16:0" in capsys.readouterr().out
    assert serve([str(out), "--print-command"]) == 0
    command = capsys.readouterr().out
    assert '"num_speculative_tokens": 5, "num_speculative_tokens_per_batch_size": [[1, 1, 5], [2, 2, 2], [3, 16, 0]]' \
        in command and "--enforce-eager" in command and f'"model": "{out}"' in command
    assert serve([str(out), "--tokens", "2", "--print-command"]) == 0  # --tokens overrides the recorded schedule
    assert "per_batch_size" not in capsys.readouterr().out
    assert convert(["engine-ready", str(MEDUSA), str(tmp_path / "m"), "--schedule", "1-4:5"]) == 2
    assert "K=5 is beyond what" in capsys.readouterr().err and not (tmp_path / "m").exists()


# -- the pieces, on real inputs ---------------------------------------------------------------------------------------

def test_sigterm_sighup_and_ctrl_c_stop_python_m_serve_through_its_server_stop():
    """`python -m serve` and `python -m eval` turn SIGINT, SIGTERM and SIGHUP into the KeyboardInterrupt that makes
    `Server.stop` take vLLM's process group down (by default SIGTERM and SIGHUP would end it at once, leaving the
    clean-up to the watchdog; SIGINT inherited as ignored would never reach it)."""
    from runtime.lifetime import stop_on_signals

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        def unchanged(signum: int, frame: object) -> None:  # stands for SIGTERM's default (ending the process)
            raise LookupError("SIGTERM kept its old handler")

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a parent that ignores Ctrl-C would hand it down
        signal.signal(signal.SIGTERM, unchanged)
        signal.signal(signal.SIGHUP, unchanged)
        stop_on_signals()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), sig)
                time.sleep(5)  # the handler runs at the next bytecode; the sleep is interrupted at once
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_prompts_fall_in_the_length_group_their_tokens_say():
    """short: 1-511 tokens, long: 512+, both bounds inclusive; each group drawn round-robin over its categories;
    a group no prompt falls into is refused, naming the lengths the set has."""
    from eval.serving.prompt_lengths import group_prompts, parse_lengths
    from runtime.errors import UserError

    pool = [("a", "chat", [7] * 40), ("b", "doc", [7] * 600), ("c", "chat", [7] * 511), ("d", "doc", [7] * 512),
            ("e", "code", [7] * 90), ("f", "doc", [7] * 1500)]
    short, long = group_prompts(parse_lengths(["short", "long"]), pool, None, "builtin")
    assert (short.ids, long.ids) == (("a", "c", "e"), ("b", "d", "f"))
    assert short.record()["prompt_tokens"] == {"median": 90, "min": 40, "max": 511}
    assert long.record()["bounds"] == [512, None] and long.record()["prompts"] == 3
    (two,) = group_prompts(parse_lengths(["short:2"]), pool, 10, "builtin")  # name:N over num_prompts, by category
    assert two.ids == ("a", "e")
    (one,) = group_prompts(parse_lengths("long"), pool, 1, "builtin")
    assert one.ids == ("b",) and one.prompts == ((7,) * 600,)
    with pytest.raises(UserError) as e:
        group_prompts(parse_lengths(["long"]), pool[:1] + pool[4:5], 8, "chats.jsonl")
    assert "no prompt of prompts=chats.jsonl falls in 'long' (512+ tokens" in str(e.value)
    assert "its 2 eval prompts run 40-90 tokens" in str(e.value)


@pytest.mark.slow
def test_on_the_builtin_split_long_is_its_long_context_category_and_short_the_chat_ones(smollm2):
    from data.prompts import load_prompt_pool
    from eval.serving.prompt_lengths import group_prompts, parse_lengths, rendered_pool

    pool = rendered_pool(load_prompt_pool("builtin"), smollm2.tokenizer, smollm2.rendering)
    cats = {cid: cat for cid, cat, _ in pool}
    short, long = group_prompts(parse_lengths(["short", "long:8"]), pool, 16, "builtin")
    assert len(long.ids) == 8 and {cats[i] for i in long.ids} == {"long_context"}
    assert min(len(p) for p in long.prompts) >= 512
    assert len(short.ids) == 16 and "long_context" not in {cats[i] for i in short.ids}
    assert len({cats[i] for i in short.ids}) == 10  # round-robin: every chat category
    (every,) = group_prompts(parse_lengths(["long"]), pool, None, "builtin")
    assert len(every.ids) == sum(c == "long_context" for c in cats.values())


def test_a_length_group_no_prompt_falls_into_is_refused_before_any_server(tmp_path, capsys):
    """Checked once the verifier's tokenizer has rendered the prompts, before any vLLM server starts."""
    from scripts.bench.serving_load import main

    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"prompt": q}) for q in ("What is a prime?", "Name a colour.")) + "\n")
    assert main([str(EAGLE3), "--prompts", str(chats), "--lengths", "short", "long", "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"no prompt of prompts={chats} falls in 'long' (512+ tokens" in err and "leave 'long' out" in err.lower()
    assert not (tmp_path / "out" / "vllm_load").exists()

def test_the_schedule_takes_each_concurrencys_best_k_and_merges_neighbours():
    from eval.serving.sweep import schedule_of
    from serve.server import format_schedule, parse_schedule

    rows = [{"concurrency": 1, "best_k": 3}, {"concurrency": 2, "best_k": 3}, {"concurrency": 4, "best_k": 1},
            {"concurrency": 8, "best_k": 0}, {"concurrency": 16, "best_k": 0}]
    schedule = schedule_of(rows, 16)
    assert schedule == ((1, 2, 3), (3, 4, 1), (5, 16, 0))
    assert parse_schedule(format_schedule(schedule)) == schedule
    assert schedule_of([{"concurrency": 4, "best_k": 2}], 4) == ((1, 4, 2),)


def test_what_an_export_drafts_is_read_from_its_config():
    from serve.server import most_drafts

    assert most_drafts(json.loads((MEDUSA / "config.json").read_text())) == 4  # its heads
    assert most_drafts(json.loads((ROOT / "pretrained/dflash-smollm2/config.json").read_text())) == 7  # block - 1
    assert most_drafts(json.loads((EAGLE3 / "config.json").read_text())) is None  # recurrent: any K


def test_the_batch_cost_model_finds_the_crossover_where_verifying_gets_dear():
    """Verify costs flat in width at batch 1 (memory-bound) and linear in tokens at batch 16 (compute-bound): the
    best K falls with the batch and speculation stops paying; negative control: flat costs everywhere pay at every
    batch size."""
    from eval.serving.batch_cost import expected_tokens, predict

    table = [[0.8], [0.8], [0.8]]
    batches, ks = [1, 4, 16], [1, 2, 3]
    costs = {(b, w): 10.0 * max(1.0, b * w / 8) for b in batches for w in (1, 2, 3, 4)}
    pred = predict(costs, batches, ks, table)
    assert pred.expected_tokens[3] == pytest.approx(expected_tokens([0.8, 0.8, 0.8]))
    assert pred.best_k[1] == 3 and pred.best_k[16] == 0 and pred.crossover == 16
    assert pred.best_k[4] < pred.best_k[1]
    flat = predict({(b, w): 10.0 for b in batches for w in (1, 2, 3, 4)}, batches, ks, table)
    assert flat.crossover is None and set(flat.best_k.values()) == {3}


@pytest.mark.slow
def test_batched_verify_costs_are_measured_on_the_real_verifier(smollm2):
    import torch

    from eval.serving.batch_cost import verify_costs

    costs = verify_costs(smollm2.model, torch.arange(1, 33)[None], [1, 2], [1, 3], reps=1)
    assert set(costs) == {(1, 1), (1, 3), (2, 1), (2, 3)} and all(ms > 0 for ms in costs.values())


# -- the real server --------------------------------------------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env(monkeypatch):
    # the `vllm` fixture runs vLLM's engine core in-process for the offline tests; the server keeps its default
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}


@pytest.mark.engine
@pytest.mark.slow
def test_python_m_serve_serves_the_shipped_eagle3_with_its_schedule_to_a_real_client(vllm, smollm2, monkeypatch):
    """The one command, started as a user starts it: it prints the address and the speculative settings, a real
    client's greedy answers equal plain greedy decoding token for token, and vLLM applies the schedule (K = 2 at
    batch size 1: two draft tokens per drafting step; K = 1 at 2). Ctrl-C stops it and its server."""
    import torch

    from data.chat import prompt_ids
    from serve.client import run_pass
    from serve.server import spec_counters

    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "serve", str(EAGLE3), "--port", str(port), "--dtype", "float32",
                             "--schedule", "1-1:2,2-2:1", "--max-num-seqs", "2", "--max-model-len", "512"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_server_env(monkeypatch), start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while not any("ready at" in ln for ln in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
            if select.select([proc.stdout], [], [], 5)[0]:
                lines.append(proc.stdout.readline())
        started = next(ln for ln in lines if "[serve] starting" in ln)
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/v1" in started and "model name 'eagle3-smollm2'" in started
        assert "K per batch size 1-1:2,2-2:1" in started and "--enforce-eager" in started
        assert '"num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 2, 1]]' in started
        assert '"method": "eagle3"' in started and "smollm2-135m-instruct" in started

        questions = ["What is a prime number?", "Name three colours of the rainbow."]
        prompts = [prompt_ids(smollm2.tokenizer, [{"role": "user", "content": q}]) for q in questions]
        before = spec_counters(url)
        one = run_pass(url, "eagle3-smollm2", prompts, 16, 1)  # one request at a time: batch size 1, K = 2
        at_one = spec_counters(url)
        with torch.inference_mode():
            for ids, answer in zip(prompts, one.outputs):
                plain = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
                assert answer == plain[0, len(ids):].tolist()
        drafts = at_one["num_drafts"] - (before or {}).get("num_drafts", 0)
        assert drafts > 0 and at_one["num_draft_tokens"] - (before or {}).get("num_draft_tokens", 0) == 2 * drafts
        assert len(at_one["accepted_per_pos"]) == 2

        two = run_pass(url, "eagle3-smollm2", prompts, 16, 2)  # both at once: batch size 2 drafts K = 1 a step
        after = spec_counters(url)
        assert two.outputs == one.outputs
        d, t = after["num_drafts"] - at_one["num_drafts"], after["num_draft_tokens"] - at_one["num_draft_tokens"]
        assert d > 0 and t < 2 * d
    finally:
        proc.send_signal(signal.SIGINT)
        hung = _hang(proc, lines, 120)
    assert not hung, hung
    assert proc.returncode == 0
    with socket.socket() as s:  # the server went with it
        assert s.connect_ex(("127.0.0.1", port)) != 0


def _hang(proc: subprocess.Popen, lines: list[str], timeout: float) -> str:
    """Wait for `python -m serve` to end: "" when it does. When it does not, its threads' stacks (SIGUSR1) and its
    output, and both it and vLLM's process group are killed, so a hang fails this test alone and leaves no server
    holding the memory the next vLLM needs."""
    try:
        proc.wait(timeout)
        return ""
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack to its stderr (our pipe)
        time.sleep(2)
        groups = [int(m) for ln in lines for m in re.findall(r"process group (\d+)", ln)]
        for group in (*groups, proc.pid):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rest = proc.communicate(timeout=30)[0] or ""
        return f"python -m serve did not stop within {timeout:.0f} s of SIGINT:\n{''.join(lines[-20:])}{rest[-6000:]}"


@pytest.mark.engine
@pytest.mark.slow
def test_the_concurrency_sweep_by_prompt_length_writes_rows_schedule_and_prediction(vllm, tmp_path, monkeypatch,
                                                                                      capsys):
    """`python -m eval checkpoint=pretrained/eagle3-smollm2 engine_peers=[vllm] engine_concurrency=[2,1]
    engine_peer_tokens=[1] engine_prompt_lengths=[short:2,long:2]` (2 prompts each, 8 tokens; our decoder drafting a
    chain of 1: no cost curve to measure). report.json's engine_peers.vllm: per length group its prompts' token counts,
    its own rows and schedule; the whole set's rows pool the groups (every request, their tokens and seconds, vLLM's
    counters summed), each with plain and K=1 figures read from the client and from vLLM's counters; a schedule over
    batch sizes 1-2 measured once more where it drafts somewhere (one of K=0 everywhere is plain, already measured, and
    says so); the prediction beside it; servers that fit the long prompt and cache no
    prefix across passes; a table per group in the terminal, the plot; and the run's export, verifier and prompt sets
    each read once, the sweep's included."""
    from eval.harness import evaluate

    _server_env(monkeypatch)
    out = tmp_path / "eval"
    cfg = _eval_cfg([f"checkpoint={EAGLE3}", "drafter=export", "alone=false", "tree=chain", "tree.depth=1",
                     "engine_peers=[vllm]", "engine_concurrency=[2,1]", "engine_peer_tokens=[1]", "num_prompts=2",
                     "engine_prompt_lengths=[short:2,long:2]", "max_new_tokens=8", "threads=2",
                     f"output_dir={out}"])
    calls = count_reads(monkeypatch)
    report = evaluate(cfg, progress=False)
    # the sweep is handed the run's export, verifier and prompt pool: nothing is read or loaded a second time
    assert dict(calls) == {"read_config": 1, "load_export": 1, "load_verifier": 1, "load_conversations": 1}
    peer = json.loads((out / "report.json").read_text())["engine_peers"]["vllm"]
    assert peer == json.loads(json.dumps(report["engine_peers"]["vllm"]))
    assert peer["version"] == vllm.VERSION and peer["errors"] == []
    assert peer["setup"]["lengths"] == ["short", "long"] and peer["setup"]["prompts"] == 4
    short, long = peer["by_length"]["short"], peer["by_length"]["long"]
    assert short["prompts"] == 2 and short["prompt_tokens"]["max"] <= 511 and short["bounds"] == [1, 511]
    assert long["prompts"] == 2 and long["prompt_tokens"]["min"] >= 512
    assert peer["setup"]["max_model_len"] >= long["prompt_tokens"]["max"] + 8
    # every pass prefills its prompts: no prefix cache carries one pass's prompts into the next
    assert "enable_prefix_caching=False" in (out / "vllm_load" / "vllm-plain.log").read_text()
    for group, n in ((short, 2), (long, 2)):
        assert [r["concurrency"] for r in group["by_concurrency"]] == [1, 2]
        _check_schedule(group)
        for r in group["by_concurrency"]:
            (spec,) = r["spec"]
            assert r["plain_tokens_per_s"] > 0 and spec["k"] == 1 and spec["tokens"] == 8 * n
            assert spec["counts"]["num_drafts"] > 0
        assert set(group["measured_best_k"]) == {"1", "2"}
    rows = peer["by_concurrency"]  # the whole set: both groups' passes pooled
    assert [r["concurrency"] for r in rows] == [1, 2]
    for i, r in enumerate(rows):
        assert r["plain_tokens_per_s"] > 0 and set(r["plain_per_request_tokens_per_s"]) == {"median", "p90"}
        (spec,) = r["spec"]
        assert spec["k"] == 1 and spec["tokens_per_s"] > 0
        assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / r["plain_tokens_per_s"])
        assert set(spec["per_request_tokens_per_s"]) == {"median", "p90"} and spec["ttft_s"]["median"] > 0
        counts = spec["counts"]  # vLLM's own counters, read from /metrics around the pass
        assert counts["num_drafts"] > 0 and counts["num_draft_tokens"] == counts["num_drafts"]
        assert spec["acceptance_length"] == pytest.approx(1 + counts["num_accepted_tokens"] / counts["num_drafts"])
        assert len(spec["acceptance_per_position"]) == 1
        parts = [g["by_concurrency"][i]["spec"][0] for g in (short, long)]
        assert spec["tokens"] == 32 and spec["seconds"] == pytest.approx(sum(p["seconds"] for p in parts))
        assert counts["num_drafts"] == sum(p["counts"]["num_drafts"] for p in parts)
        assert r["best_k"] in (0, 1)
    _check_schedule(peer)
    ranges = peer["schedule"]["ranges"]
    assert ranges[0][0] == 1 and ranges[-1][1] == 2
    assert peer["schedule"]["as_vllm"]["num_speculative_tokens_per_batch_size"] == ranges
    pred = peer["prediction"]
    assert set(pred["best_k"]) == {"1", "2"} and set(pred["speedup"]["1"]) == {"1"}
    printed = capsys.readouterr().out
    assert "short: 2 prompts of" in printed and "long: 2 prompts of" in printed and "every group pooled" in printed
    assert (out / "load_speedup.png").is_file() and (out / "vllm_load" / "vllm-plain.log").is_file()


def _check_schedule(view: dict) -> None:
    """A schedule that drafts at some batch size was served once more (its rows carry scheduled figures); one of
    K=0 everywhere is plain decoding: not served, no scheduled speedup, and the note says to serve --plain (whether
    K=1 pays on 8 tokens depends on the machine)."""
    rows = view["by_concurrency"]
    if any(k for *_, k in view["schedule"]["ranges"]):
        assert view["schedule"]["accepted_by_vllm"] is True and view["schedule_note"] is None
        assert all(r["scheduled_tokens_per_s"] > 0 and r["scheduled_speedup"] > 0 for r in rows)
    else:
        assert view["schedule"]["accepted_by_vllm"] is None and "--plain" in view["schedule_note"]
        assert all("scheduled_speedup" not in r for r in rows)


@pytest.mark.engine
@pytest.mark.slow
def test_vllm_fails_medusa_under_a_schedule_and_the_cause_is_named(vllm, monkeypatch, tmp_path):
    """vLLM 0.32 takes num_speculative_tokens_per_batch_size for Medusa at start, then its Medusa proposer asserts
    the configured K every step (vllm/v1/spec_decode/medusa.py): at a batch size whose K differs the engine dies.
    The client says so (no silent short answers) and log_cause names vLLM's assertion. If a later vLLM drafts
    Medusa under a schedule, this test fails: then the sweep's Medusa rows need no caveat."""
    from serve.client import run_pass
    from serve.server import Server, ServeSettings, prepare, read_export
    from serve.vllm_engine import log_cause

    _server_env(monkeypatch)
    info = read_export(MEDUSA)
    verifier, served = prepare(info)
    settings = ServeSettings(verifier, served, info.kind, None, ((1, 1, 2), (2, 2, 1)), port=_port(),
                             max_num_seqs=2, max_model_len=512, dtype="float32", name="medusa")
    prompts = [[1, 9690, 198, 2683, 359, 253], [1, 9690, 198, 2683, 359, 253, 28]]
    with Server(settings, log=tmp_path / "vllm.log") as server:
        assert len(run_pass(settings.url, "medusa", prompts[:1], 8, 1).outputs[0]) == 8  # batch 1: K = 2, the max
        with pytest.raises(RuntimeError):
            run_pass(settings.url, "medusa", prompts, 8, 2)  # batch 2: K = 1
        time.sleep(2)
        cause = log_cause(server.log.read_text())
    assert "AssertionError" in cause and "num_speculative_tokens" in cause and "medusa.py" in cause

"""Serve, record, retrain (issue 80): `python -m serve EXPORT --record DIR` keeps each finished request as a served
record (data/served.py) holding exactly the tokens the server returned, clients still see vLLM's normal API,
`python train.py data=served data.source=DIR` trains from it as it is (with a replay sample of the shipped set), and a
fine-tuned export's drafter weights load into the running server in place (`--reload-into`).

The first tests need no server (the refusals come before one would start); the rest share one real vLLM server,
started by the real command line (they skip without its virtualenv, and fail under CI=true).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import ROOT

EAGLE3 = ROOT / "pretrained" / "eagle3-smollm2"
MEDUSA = ROOT / "pretrained" / "medusa-smollm2"
PROMPTS = ["What is a prime number?", "Give me two tips for sleeping well.", "Name three colours of the rainbow."]


def _serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from serve.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _record(folder: Path, verifier, lines: list[dict]) -> Path:
    """A served record of `verifier` holding `lines`, as a server leaves one."""
    from serve.record import RECORDS, open_record

    open_record(folder, verifier, EAGLE3, "0.32.0")
    with open(folder / RECORDS, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return folder


def _line(prompt: list[int], answer: list[int], reason: str | None, rid: str = "r") -> dict:
    return {"id": rid, "endpoint": "/v1/chat/completions", "messages": [{"role": "user", "content": "x"}],
            "choices": [{"index": 0, "prompt_ids": prompt, "answer_ids": answer, "finish_reason": reason}]}


# -- refusals and the record's reading, no server ---------------------------------------------------------------------

def test_a_folder_holding_other_things_is_refused_before_anything_loads(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, out = _serve([str(EAGLE3), "--record", str(tmp_path), "--print-command"], capsys)
    assert code == 2 and "holds ['notes.txt'] and no served record" in out and "new or empty folder" in out
    assert "--speculative-config" not in out  # nothing was prepared
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # and nothing written or deleted
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "file").write_text("")
    code, out = _serve([str(EAGLE3), "--record", str(tmp_path / "file"), "--print-command"], capsys)
    assert code == 2 and "it is a file, not a folder" in out


@pytest.mark.slow
def test_the_printed_command_records_and_reloads_as_python_m_serve_would(tmp_path, capsys):
    """--print-command with --record: the folder made ready (its manifest), the command with vLLM's --middleware and
    --worker-extension-cls and the environment that points them at engine_side/ and the record."""
    from serve.server import ENGINE_SIDE

    code, out = _serve([str(EAGLE3), "--record", str(tmp_path / "rec"), "--print-command"], capsys)
    assert code == 0, out
    assert "--middleware specdraft_record.Recorder" in out
    assert "--worker-extension-cls specdraft_reload.DrafterReload" in out
    assert f"PYTHONPATH={ENGINE_SIDE}" in out and f"SPECDRAFT_RECORD_DIR={tmp_path / 'rec'}" in out
    assert json.loads((tmp_path / "rec" / "manifest.json").read_text())["format"] == "specdraft-served-record"
    code, out = _serve([str(EAGLE3), "--print-command"], capsys)  # without: vLLM as before, nothing of ours loaded
    assert code == 0 and "--middleware" not in out and "PYTHONPATH" not in out


@pytest.mark.parametrize("extra, words", [
    (["--plain", "--record", "DIR"], "--record records or reloads a drafter's serving; with --plain there is none"),
    (["--reload-into", "http://127.0.0.1:9", "--plain"], "--plain has nothing to set"),
    (["--reload-into", "http://127.0.0.1:9", "--record", "DIR"], "--record has nothing to set"),
])
def test_options_that_contradict_recording_or_reloading_are_refused(extra, words, capsys, tmp_path):
    argv = [str(tmp_path / "rec") if a == "DIR" else a for a in extra]
    if "--reload-into" not in extra:
        argv.append("--print-command")  # a refusal that stopped working prints the command, starting nothing
    code, out = _serve([str(EAGLE3), *argv], capsys)
    assert code == 2 and words in out


@pytest.mark.slow
def test_another_verifiers_record_is_refused_by_the_server_and_by_the_trainer(tiny, smollm2, tmp_path):
    from data.served import load_served
    from runtime.errors import UserError, VerifierMismatchError
    from serve.record import MANIFEST, open_record

    folder = _record(tmp_path / "rec", tiny, [_line([1, 2], [3, 2], "stop")])
    before = (folder / MANIFEST).read_text()
    with pytest.raises((UserError, VerifierMismatchError), match="different verifier"):
        open_record(folder, smollm2, EAGLE3, "0.32.0")
    with pytest.raises((UserError, VerifierMismatchError), match="different verifier"):
        load_served(folder, smollm2)
    assert (folder / MANIFEST).read_text() == before  # the refused session is not noted
    # The same verifier appends: a second session, the records kept.
    open_record(folder, tiny, EAGLE3, "0.32.0")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert len(manifest["sessions"]) == 2 and len(load_served(folder, tiny)) == 1


@pytest.mark.slow
def test_the_trainer_reads_finished_answers_with_the_loss_on_the_answer_only(tiny, tmp_path, capsys):
    from data.served import load_served
    from runtime.errors import UserError

    folder = _record(tmp_path / "rec", tiny, [_line([5, 6, 7], [8, 9, 2], "stop", "a"),
                                              _line([5, 6], [10, 11], "length", "b"),
                                              _line([5], [12], "abort", "c"), _line([5], [], "stop", "d")])
    with open(folder / "records.jsonl", "a") as f:
        f.write('{"id": "cut by a ki')  # a line a kill cut mid-write
    ds = load_served(folder, tiny)
    assert ds["input_ids"] == [[5, 6, 7, 8, 9, 2], [5, 6, 10, 11]]
    assert ds["loss_mask"] == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1]]
    assert ds["id"] == ["a-0", "b-0"] and set(ds["source"]) == {"served:rec"}
    out = capsys.readouterr().out
    assert "2 answers; skipped 1 abort, 1 no tokens, 1 unreadable lines" in out
    assert load_served(folder, tiny, max_length=4)["input_ids"][0] == [5, 6, 7, 8]
    # data.prompt_loss: the prompt's tokens are targets too, all but the first (nothing before it to predict from).
    with_prompt = load_served(folder, tiny, prompt_loss=True)
    assert with_prompt["loss_mask"] == [[0, 1, 1, 1, 1, 1], [0, 1, 1, 1]]
    assert with_prompt._fingerprint != ds._fingerprint  # its own hidden-state cache key
    from data.datamodule import DistillDataModule
    with pytest.raises(UserError, match="data.prompt_loss=true is for data=served"):
        DistillDataModule(tiny, str(tmp_path / "cache"), mode="shipped", prompt_loss=True)
    # An empty record, and a folder that is none, are refused with what to do.
    empty = _record(tmp_path / "empty", tiny, [])
    with pytest.raises(UserError, match="holds no finished answer .0 requests recorded.: serve with --record"):
        load_served(empty, tiny)
    with pytest.raises(UserError, match="no served record there"):
        load_served(tmp_path / "nothing", tiny)


@pytest.mark.slow
def test_regenerate_has_the_verifier_answer_the_recorded_chat_prompts_again(tiny, tmp_path):
    """data.regenerate=N: N sampled answers of the verifier's own to each recorded chat prompt, beside the record's
    own rows; completion requests (no messages) and unfinished ones are not answered again."""
    from data.chat import prompt_ids
    from data.datamodule import DistillDataModule
    from runtime.errors import UserError

    chat = [{"role": "user", "content": "Sort a list of numbers in Python."}]
    rendered = prompt_ids(tiny.tokenizer, chat, tiny.rendering)
    lines = [_line(rendered, [8, 9, 2], "stop", "a") | {"messages": chat},
             {"id": "b", "endpoint": "/v1/completions", "prompt": "def f(x):",
              "choices": [{"index": 0, "prompt_ids": [5, 6], "answer_ids": [7, 2], "finish_reason": "stop"}]},
             _line([5], [12], "abort", "c")]
    folder = _record(tmp_path / "rec", tiny, lines)

    def module(**kw):
        return DistillDataModule(tiny, str(tmp_path / "cache"), mode="served", source=str(folder), shipped=[],
                                 max_new_tokens=6, gen_batch_size=4, **kw)

    ds = module(regenerate=3, regenerate_temperature=1.0).build()
    recorded = [r for r in ds if r["source"] == "served:rec"]
    again = [r for r in ds if r["source"] == "regenerated:rec"]
    assert len(recorded) == 2 and len(again) == 3  # the two finished answers; three more to the one chat prompt
    answers = []
    for r in again:
        assert r["input_ids"][: len(rendered)] == rendered  # the recorded prompt, as the server rendered it
        assert sum(r["loss_mask"][: len(rendered)]) == 0 and sum(r["loss_mask"]) == len(r["input_ids"]) - len(rendered)
        answers.append(tuple(r["input_ids"][len(rendered):]))
    assert len(set(answers)) > 1  # sampled, each copy seeded apart
    # The same settings read the cache: the same answers.
    again2 = [r for r in module(regenerate=3, regenerate_temperature=1.0).build() if r["source"] == "regenerated:rec"]
    assert [tuple(r["input_ids"][len(rendered):]) for r in again2] == answers
    for kw, words in (({"regenerate": 2, "regenerate_temperature": 0.0}, "greedy decoding would write the recorded"),
                      ({"regenerate": -1}, "a whole number >= 0")):
        with pytest.raises(UserError, match=words):
            module(**kw)
    with pytest.raises(UserError, match="it is for data=served"):
        DistillDataModule(tiny, str(tmp_path / "cache"), mode="shipped", regenerate=2)


# -- the real server --------------------------------------------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(record: Path) -> tuple[str, subprocess.Popen[str]]:
    """`python -m serve EAGLE3 --record RECORD` on a free port, once it says it is ready: (its URL, the process)."""
    port = _port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # the server's default
    proc = subprocess.Popen([sys.executable, "-m", "serve", str(EAGLE3), "--record", str(record), "--port", str(port),
                             "--max-num-seqs", "2", "--max-model-len", "512"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 600
    while not any("ready at" in ln for ln in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
        lines.append(proc.stdout.readline())
    return f"http://127.0.0.1:{port}", proc


@pytest.fixture(scope="module")
def served(vllm, tmp_path_factory):
    """One server per module (per xdist worker), its record folder, and the process; stopped after the module."""
    state: dict = {"record": tmp_path_factory.mktemp("served") / "record", "proc": None}
    yield state
    if state["proc"] is not None:
        state["proc"].send_signal(signal.SIGTERM)
        try:
            state["proc"].communicate(timeout=120)
        except subprocess.TimeoutExpired:
            state["proc"].kill()


@pytest.fixture
def server(served):
    """(URL, record folder, process) of the module's server, started again into the same record (the append path)
    where a test before this one killed it."""
    if served["proc"] is None or served["proc"].poll() is not None:
        served["url"], served["proc"] = _start(served["record"])
    return served["url"], served["record"], served["proc"]


def _chat(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": "eagle3-smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 48,
            "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]


@pytest.mark.engine
@pytest.mark.slow
def test_each_request_is_recorded_with_the_tokens_the_server_returned(server, smollm2):
    from data.chat import prompt_ids

    url, record, _ = server
    start = len(_records(record))
    tok = smollm2.tokenizer
    # 1. a chat request as any client sends it: the normal API back, no token ids in it
    r = _chat(url, PROMPTS[0])
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["token_ids"] is None and body["prompt_token_ids"] is None
    assert body["prompt_text"] is None
    # 2. streamed: each chunk as vLLM sends it, the record from the deltas
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300, json={
            "model": "eagle3-smollm2", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 48,
            "temperature": 0, "stream": True}) as s:
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert all(c.get("token_ids") is None for e in events for c in e["choices"])
    assert events[0]["prompt_token_ids"] is None
    # 3. a completion whose client asked for the token ids: they stay in its answer
    c = httpx.post(f"{url}/v1/completions", json={"model": "eagle3-smollm2", "prompt": "The capital of France is",
                                                  "max_tokens": 8, "temperature": 0, "return_token_ids": True},
                   timeout=300).json()["choices"][0]
    records = _records(record)[start:]
    assert len(records) == 3
    chat, stream, completion = records
    for rec, prompt in ((chat, PROMPTS[0]), (stream, PROMPTS[1])):
        choice = rec["choices"][0]
        assert choice["prompt_ids"] == prompt_ids(tok, [{"role": "user", "content": prompt}])  # the chat rendering
        assert rec["prompt_text"] == tok.decode(choice["prompt_ids"])
        assert choice["finish_reason"] in ("stop", "length") and rec["sampling"]["max_tokens"] == 48
    assert tok.decode(chat["choices"][0]["answer_ids"], skip_special_tokens=True) == \
        body["choices"][0]["message"]["content"]
    assert chat["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
    assert tok.decode(stream["choices"][0]["answer_ids"], skip_special_tokens=True) == streamed
    assert stream["stream"] is True
    assert completion["choices"][0]["answer_ids"] == c["token_ids"]  # exactly what the client got
    assert completion["choices"][0]["prompt_ids"] == c["prompt_token_ids"] == tok("The capital of France is").input_ids
    assert completion["prompt"] == "The capital of France is"


def _tau(url: str) -> dict:
    from serve.server import counter_delta, spec_counters

    before = spec_counters(url)
    for p in PROMPTS:
        assert _chat(url, p).status_code == 200
    delta = counter_delta(before, spec_counters(url))
    assert delta is not None
    return delta


@pytest.mark.engine
@pytest.mark.slow
def test_a_fine_tuned_drafter_loads_into_the_running_server_in_place(server, tmp_path, capsys):
    """A drafter with random layers, loaded in place, drafts nothing the verifier accepts; the export served at the
    start, loaded back, accepts exactly what it accepted before: the weights the engine drafts with are the ones
    loaded, and the verifier's own weights are untouched. Another family's export is refused, the server unchanged."""
    import torch
    from safetensors.torch import load_file, save_file

    url, _, _ = server
    first = _tau(url)
    assert first["num_accepted_tokens"] > 0.2 * first["num_draft_tokens"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((EAGLE3 / "config.json").read_text())
    weights = load_file(EAGLE3 / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if w.is_floating_point() and w.ndim == 2 and name != "lm_head.weight":
            weights[name] = (torch.randn(w.shape, generator=g) * 0.05).to(w.dtype)
    save_file(weights, broken / "model.safetensors")
    code, out = _serve([str(broken), "--reload-into", url], capsys)
    assert code == 0 and "loaded in place" in out, out
    random = _tau(url)
    assert random["num_accepted_tokens"] < 0.05 * random["num_draft_tokens"]  # a chance newline at most
    code, out = _serve([str(MEDUSA), "--reload-into", url], capsys)
    assert code == 2 and "refused the reload (HTTP 409)" in out and "config.json differs in architectures" in out
    code, out = _serve([str(EAGLE3), "--reload-into", url], capsys)
    assert code == 0, out
    again = _tau(url)
    assert again == first


@pytest.mark.engine
@pytest.mark.slow
def test_the_trainer_retrains_from_the_record_as_it_is(server, tmp_path):
    """`python train.py experiment=retrain_served data.source=DIR` with a replay sample: the served answers, the
    verifier's regenerated answers to the recorded prompts and the replayed rows are the training set, and it
    exports."""
    _, record, _ = server
    if len(_records(record)) < 2:
        for p in PROMPTS[:2]:
            _chat(server[0], p)
    finished = [r for r in _records(record) if r["choices"][0]["finish_reason"] in ("stop", "length")]
    served, chats = len(finished), sum(1 for r in finished if r.get("messages"))
    proc = subprocess.run([sys.executable, "train.py", "experiment=retrain_served", f"data.source={record}",
                           "data.shipped=[smollm2-selfdistill-v1@4]", "data.batch_size=2", "data.max_length=256",
                           "data.regenerate=2", "data.max_new_tokens=8",
                           "data.val_fraction=0.2", "trainer.max_steps=1", "logger=csv",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"served record {record}: {served} answers" in proc.stdout
    # The recipe has the verifier answer each recorded chat prompt again (data.regenerate), sampled, beside the record.
    assert f"regenerating {2 * chats} answers (2 to each of {chats} recorded chat prompts" in proc.stdout
    n = served + 2 * chats + 4
    val = max(1, round(n * 0.2))
    assert f"{n - val} train / {val} val conversations" in proc.stdout
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()


@pytest.mark.engine
@pytest.mark.slow
def test_a_killed_server_loses_no_finished_request(server):
    """Each record is on disk when its response ends: SIGKILL to `python -m serve` (its watchdog then takes vLLM
    down) leaves every finished request recorded, each line whole."""
    url, record, proc = server
    before = len(_records(record))
    assert _chat(url, PROMPTS[2]).status_code == 200
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    records = _records(record)  # every line parses
    assert len(records) == before + 1 and records[-1]["messages"][0]["content"] == PROMPTS[2]

"""Bad input to the serving commands (issue 78): `python -m serve`, the load sweep and its script each answer with one
message that names the problem and the fix, before a verifier loads or a server starts; what vLLM says when it does
fail is headlined by its real cause, not by the first warning in its log.

No test here starts vLLM (tests/test_serve_lifetime.py does): each refusal must come before it would.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from helpers import ROOT

EAGLE3 = ROOT / "pretrained" / "eagle3-smollm2"
MEDUSA = ROOT / "pretrained" / "medusa-smollm2"
LOGS = Path(__file__).with_name("vllm_logs")


def _serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from serve.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# -- the schedule and the options ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["1-2-3:4", "1-2:3:4", "1-2:x", "a-2:3", "1-2", "1--2:3", "1-2:3;3-4:1"])
def test_a_schedule_range_is_read_whole_or_refused(text):
    """`1-2-3:4` was read as `1-2:4`: every range must be FIRST-LAST:K or SIZE:K exactly."""
    from runtime.errors import UserError
    from serve.server import parse_schedule

    with pytest.raises(UserError, match="is not FIRST-LAST:K"):
        parse_schedule(text)


def test_well_formed_schedules_still_parse():
    from serve.server import parse_schedule

    assert parse_schedule("1-2:3,3-16:1") == ((1, 2, 3), (3, 16, 1))
    assert parse_schedule("1:5, 2-4:0") == ((1, 1, 5), (2, 4, 0))


@pytest.mark.parametrize("extra, words", [
    (["--plain", "--tokens", "5"], "--plain serves the verifier alone, so --tokens has nothing to set"),
    (["--plain", "--schedule", "1-4:2"], "--plain serves the verifier alone, so --schedule has nothing to set"),
    (["--schedule", "1-16:0"], "drafts nothing at any batch size"),
])
def test_options_that_would_be_ignored_or_bent_are_refused(extra, words, capsys):
    code, out = _serve([str(EAGLE3), *extra, "--print-command"], capsys)
    assert code == 2 and words in out
    assert "--speculative-config" not in out  # nothing was prepared
    if "1-16:0" in extra:
        assert "Serve --plain instead" in out and "0.70-0.81x plain" in out


def test_a_schedule_that_stops_drafting_above_a_batch_size_says_what_that_costs(capsys):
    code, out = _serve([str(EAGLE3), "--schedule", "1-2:3,3-16:0", "--print-command"], capsys)
    assert code == 0
    assert "at batch sizes 3-16 this schedule drafts nothing (K=0)" in out and "`--plain` serves faster" in out
    code, out = _serve([str(EAGLE3), "--schedule", "1-16:3", "--print-command"], capsys)
    assert code == 0 and "drafts nothing" not in out


@pytest.mark.parametrize("content", ["{not json", '{"command": "x"}', '{"num_speculative_tokens_per_batch_size": 3}',
                                     '{"num_speculative_tokens_per_batch_size": [["a", 2, 3]]}'])
def test_a_damaged_serve_json_is_named_with_the_way_to_write_it_again(content, tmp_path, capsys):
    served = tmp_path / "served"
    shutil.copytree(EAGLE3, served)
    (served / "specdraft" / "serve.json").write_text(content)
    code, out = _serve([str(served), "--print-command"], capsys)
    assert code == 2 and "Traceback" not in out
    assert f"{served / 'specdraft' / 'serve.json'} is damaged" in out and "convert engine-ready" in out


# -- the address ---------------------------------------------------------------------------------------------------

def test_a_port_in_use_is_refused_before_anything_loads(capsys):
    with socket.socket() as other:  # another server holds the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        code, out = _serve([str(EAGLE3), "--port", str(port)], capsys)
    assert code == 2 and f"port {port} on 127.0.0.1 is already in use" in out and "give another --port" in out
    assert "loading the verifier" not in out


def test_an_ipv6_loopback_host_is_bracketed_in_the_url():
    """`--host ::1` made http://::1:8000, which httpx refuses (InvalidURL)."""
    import httpx

    from serve.server import ServeSettings

    settings = ServeSettings("v", host="::1", port=8123)
    assert settings.url == "http://[::1]:8123"
    httpx.URL(f"{settings.url}/health")  # parses
    assert ServeSettings("v", host="127.0.0.1", port=8123).url == "http://127.0.0.1:8123"


@pytest.mark.parametrize("host, words", [("nosuch.invalid", "is not an address or a name this machine resolves"),
                                         ("192.0.2.7", "this machine cannot listen there")])
def test_a_host_this_machine_cannot_serve_on_is_named(host, words, capsys):
    code, out = _serve([str(EAGLE3), "--host", host], capsys)
    assert code == 2 and words in out and "Traceback" not in out


def test_a_non_loopback_host_without_an_api_key_is_warned_and_the_key_stays_off_the_command_line(capsys,
                                                                                                  monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    code, out = _serve([str(EAGLE3), "--host", "0.0.0.0", "--print-command"], capsys)
    assert code == 0 and "warning: --host 0.0.0.0 serves to every network" in out and "--api-key" in out
    code, out = _serve([str(EAGLE3), "--host", "0.0.0.0", "--api-key", "s3cret", "--print-command"], capsys)
    assert code == 0 and "warning" not in out
    assert "s3cret" not in out and "VLLM_API_KEY=<your key>" in out  # handed over in the environment
    code, out = _serve([str(EAGLE3), "--host", "127.0.0.1", "--print-command"], capsys)
    assert code == 0 and "warning" not in out


def test_the_api_key_reaches_vllm_in_its_environment():
    from serve.server import ServeSettings

    settings = ServeSettings("v", api_key="k1")
    assert settings.env()["VLLM_API_KEY"] == "k1" and "k1" not in " ".join(settings.command())


# -- what can be checked before vLLM starts --------------------------------------------------------------------------

def test_an_export_without_its_weights_is_refused_before_loading(tmp_path, capsys):
    export = tmp_path / "export"
    export.mkdir()
    shutil.copy(EAGLE3 / "config.json", export / "config.json")
    code, out = _serve([str(export)], capsys)
    assert code == 2 and f"{export} has no model.safetensors" in out and "loading the verifier" not in out
    code, out = _serve([str(export), "--plain", "--print-command"], capsys)  # no drafter: nothing of it is read
    assert code == 0


def test_a_family_the_cpu_build_refuses_is_named_from_the_registry(smollm2, tmp_path, capsys):
    """A DFlash2 export: vLLM's CPU build refuses it (tests/test_engine_vllm_dflash2.py shows it in vLLM's words)."""
    import torch

    from models.dflash2 import build_dflash2
    from models.exports.io import save_export

    torch.manual_seed(0)
    net = build_dflash2(smollm2, mask_token_id=16, block_size=4, selector_rank=8)
    export = save_export(net, smollm2, tmp_path / "export", {"eagle_topk_accuracy": [[0.5, 0.6]] * 3})
    code, out = _serve([str(export)], capsys)
    assert code == 2 and "DFlash2 export, which vLLM 0.32.0's CPU build does not serve" in out
    assert "Model Runner V2" in out and f"drafter=dflash2 checkpoint={export}" in out
    assert "loading the verifier" not in out


@pytest.mark.parametrize("log, cause", [
    ("vllm-0.32-no-weights.log", "RuntimeError: Cannot find any model weights with `/tmp/noweights`"),
    ("vllm-0.32-dflash2-on-cpu.log", "Model Runner V1 does not support: DFlash candidate-head drafts"),
])
def test_vllms_real_error_is_the_headline_not_its_ulimit_warning(log, cause, tmp_path):
    """Two logs vLLM 0.32.0 wrote here (an export without weights; a DFlash2 export): each opens with vLLM's
    "Found ulimit ... Too many open files" warning, which the cause used to be."""
    from serve.vllm_engine import EngineError, log_cause

    text = (LOGS / log).read_text()
    assert "Too many open files" in text  # the warning is there to be mistaken
    assert cause in log_cause(text) and "ulimit" not in log_cause(text)
    err = EngineError("verifier", None, text, tmp_path / "vllm.log")
    assert str(err).splitlines()[0].endswith(log_cause(text)) and f"its full log: {tmp_path / 'vllm.log'}" in str(err)


# -- the load sweep ----------------------------------------------------------------------------------------------------

def test_more_clients_than_prompts_is_refused_before_any_server(tmp_path, monkeypatch):
    """Refused before our decoder runs over the prompts (minutes on a real run), not after it."""
    from test_serve_load import _eval_cfg

    import eval.harness
    from eval.harness import evaluate
    from runtime.errors import UserError

    def decoded(*args, **kwargs):  # a fault injected where the decoding starts: reaching it is too late
        raise AssertionError("the prompts were decoded before the sweep's settings were refused")

    monkeypatch.setattr(eval.harness, "run_prompts", decoded)

    cfg = _eval_cfg([f"checkpoint={EAGLE3}", "engine_peers=[vllm]", "engine_concurrency=[1,4]", "num_prompts=2",
                     "drafter=export", "alone=false", "tree=chain", "tree.depth=1", f"output_dir={tmp_path}"])
    with pytest.raises(UserError, match=r"the run has 2 prompts, so at most 2 requests can be in flight, not 4"):
        evaluate(cfg, progress=False)
    assert not (tmp_path / "vllm_load").exists() and not (tmp_path / "report.json").exists()


def test_the_sweep_script_refuses_to_overwrite_a_report_and_makes_a_fresh_folder_by_default(tmp_path, capsys,
                                                                                            monkeypatch):
    from scripts.bench.serving_load import fresh_out, main

    out = tmp_path / "run"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"engine_peers": {"vllm": {"kept": True}}}))
    assert main([str(EAGLE3), "--out", str(out)]) == 2
    assert "holds an earlier sweep's report.json" in capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["engine_peers"]["vllm"] == {"kept": True}
    monkeypatch.chdir(tmp_path)
    first = fresh_out(None, str(EAGLE3))
    assert first.parent == Path("outputs/load") and first.name.startswith("eagle3-smollm2-")
    assert fresh_out(str(tmp_path / "new"), str(EAGLE3)) == tmp_path / "new"


def _pass(c: int, tokens: int, seconds: float):  # a pass as the client records it: one answer of `tokens` tokens
    from serve.client import Answer, Pass

    return Pass(c, [Answer(0, list(range(tokens)), 0.0, 0.1, seconds)], seconds)


def _counts(drafts: int, accepted: int) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": drafts, "num_accepted_tokens": accepted,
            "accepted_per_pos": [accepted]}


def test_a_server_that_died_mid_sweep_leaves_error_rows_and_no_schedule():
    """The K=1 server died after its concurrency-1 pass: concurrency 2 has an error entry with vLLM's cause, its
    best K is unknown, and no schedule, crossover or scheduled speedup is derived from the missing pass (it was:
    best K 0, crossover 1, a plain schedule measured against plain)."""
    from eval.serving.sweep import ALL, _crossover, _rows, _schedule_note, schedule_of, to_measure

    cause = "RuntimeError: Cannot find any model weights"
    plain = {(ALL, 1): (_pass(1, 64, 2.0), None), (ALL, 2): (_pass(2, 64, 1.0), None)}
    k1 = {(ALL, 1): (_pass(1, 64, 1.6), _counts(40, 24))}
    rows = _rows([1, 2], plain, {1: k1}, (ALL,), {"K=1": cause})
    assert rows[0]["best_k"] == 1 and rows[0]["spec"][0]["speedup"] == pytest.approx(1.25)
    assert rows[1]["spec"] == [{"k": 1, "error": cause}] and rows[1]["best_k"] is None
    assert schedule_of(rows, 2) is None and _crossover(rows) is None and to_measure([None]) == []
    assert "a pass failed" in _schedule_note(None)
    # a K whose server never started: every row says so
    rows = _rows([1, 2], plain, {1: None, 2: k1}, (ALL,), {"K=1": cause})
    assert all(r["spec"][0] == {"k": 1, "error": cause} and r["best_k"] is None for r in rows)
    # the plain server died after concurrency 1: concurrency 2 is an error row
    rows = _rows([1, 2], {(ALL, 1): plain[ALL, 1]}, {1: k1}, (ALL,), {"plain": cause})
    assert rows[1] == {"concurrency": 2, "error": cause, "spec": [], "best_k": None}


def test_a_schedule_that_drafts_nowhere_is_plain_and_is_not_measured_against_plain():
    from eval.serving.sweep import ALL, _crossover, _rows, _schedule_note, _schedule_record, schedule_of, to_measure

    plain = {(ALL, 1): (_pass(1, 64, 1.0), None), (ALL, 4): (_pass(4, 64, 0.5), None)}
    slower = {(ALL, 1): (_pass(1, 64, 1.2), _counts(40, 10)), (ALL, 4): (_pass(4, 64, 0.7), _counts(40, 8))}
    rows = _rows([1, 4], plain, {3: slower}, (ALL,), {})
    schedule = schedule_of(rows, 4)
    assert schedule == ((1, 4, 0),) and _crossover(rows) == 1
    assert to_measure([schedule]) == []  # no server for it: it would be plain against plain
    assert "serve the verifier alone" in _schedule_note(schedule) and "--plain" in _schedule_note(schedule)
    record = _schedule_record(schedule, rows, None)
    assert record["accepted_by_vllm"] is None and all("scheduled_speedup" not in r for r in rows)
    paying = {(ALL, 1): (_pass(1, 64, 0.8), _counts(40, 30)), (ALL, 4): (_pass(4, 64, 0.7), _counts(40, 8))}
    rows = _rows([1, 4], plain, {3: paying}, (ALL,), {})
    assert schedule_of(rows, 4) == ((1, 1, 3), (2, 4, 0)) and to_measure([schedule_of(rows, 4)]) != []

"""Training that fails safe: divergence keeps the good checkpoint and export, one run per name, writable outputs
checked first, safe resume, a full disk keeps the previous checkpoint, a reused name is refused; bad input on the
training side stops with one message, before any work."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import ROOT, compose_train
from runtime.errors import UserError, user_error
from train.safety import DIVERGED, LAST_GOOD, AtomicCheckpointIO, DivergenceError

TINY = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
        "data.val_fraction=0.25", "logger=csv", "trainer.max_epochs=50"]


class BlowUp(L.Callback):
    """Fault injection: right after optimizer step `at_step`, scale the trainable weights (what a huge update does),
    before any other callback sees them."""

    def __init__(self, at_step: int, scale: float = 1e6) -> None:
        self.at_step, self.scale = at_step, scale

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            with torch.no_grad():
                for p in pl_module.parameters():
                    if p.requires_grad:
                        p.mul_(self.scale).add_(self.scale)


class InfGrad(L.Callback):
    """Fault injection: an overflowed gradient at step `at_step` (the loss itself stays finite)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.at_step:
            next(p for p in pl_module.parameters() if p.grad is not None).grad[0] = float("inf")


class DiskFullIO(AtomicCheckpointIO):
    """Fault injection: the disk fills up halfway through writing a checkpoint's bytes, wherever they are written."""

    def _write(self, f, data) -> None:
        f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullDisk(L.Callback):
    """Fault injection: from the start of training on, every checkpoint write runs out of disk space. Checks first
    that train.py gave the trainer its atomic writer (the one every checkpoint save goes through)."""

    def on_train_start(self, trainer, pl_module) -> None:
        if type(trainer.strategy.checkpoint_io) is not AtomicCheckpointIO:
            raise AssertionError(f"checkpoints are written by {type(trainer.strategy.checkpoint_io).__name__}")
        trainer.strategy.checkpoint_io = DiskFullIO()


def _first(cfg, name: str, **params):
    """Put a test callback first, so it runs before the guard in every hook."""
    from omegaconf import open_dict

    test_cb = {"_target_": f"test_failsafe.{name}", **params}
    with open_dict(cfg):
        cfg.callbacks = {"fault": test_cb, **cfg.callbacks}
    return cfg


def _step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def _cli(args: list[str], run_dir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# -- divergence --------------------------------------------------------------------------------------------------------
def test_divergence_keeps_the_last_good_checkpoint_and_the_export(train_script, tmp_path):
    every2 = [*TINY, "callbacks.checkpoint.every_n_train_steps=2"]
    train_script.run(compose_train([*every2, "trainer.max_steps=3"], tmp_path))
    export = tmp_path / "export" / "model.safetensors"
    before = export.read_bytes()
    cfg = _first(compose_train([*every2, "trainer.max_steps=40", "ckpt_path=last"], tmp_path), "BlowUp", at_step=8)
    with pytest.raises(DivergenceError, match="above 1000 x its running level") as err:
        train_script.run(cfg)
    good = tmp_path / "checkpoints" / LAST_GOOD
    # Candidates at steps 4 and 6 were each confirmed by the next step's loss; the weights after step 8 were not.
    assert _step(good) == 6
    assert f"ckpt_path={good}" in str(err.value) and "(step 6)" in str(err.value)
    assert export.read_bytes() == before  # never exported from the diverged state
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # `ckpt_path=last` cannot resume diverged weights
    assert (tmp_path / "checkpoints" / DIVERGED).is_file()
    with pytest.raises(UserError, match=f"resume with ckpt_path={good}"):
        train_script.run(compose_train([*every2, "ckpt_path=last"], tmp_path))
    # The advice works: resuming from the good checkpoint trains on, healthy, and exports.
    train_script.run(compose_train([*every2, "trainer.max_steps=12", f"ckpt_path={good}"], tmp_path))
    assert _step(tmp_path / "checkpoints" / "last.ckpt") == 12 and export.read_bytes() != before


def test_huge_learning_rate_on_the_command_line_exits_2_and_keeps_the_export(train_script, tmp_path):
    """The issue's reproduction: lr=1e9 used to reach a loss of 1e7, exit 0 and overwrite the export."""
    train_script.run(compose_train(["experiment=smoke", *TINY, "trainer.max_steps=2"], tmp_path))
    before = (tmp_path / "export" / "model.safetensors").read_bytes()
    proc = _cli(["experiment=smoke", *TINY, "model.optimizer.lr=1e9", "overwrite=true"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: training diverged at step " in proc.stderr and "Traceback" not in proc.stderr
    assert "model.optimizer.lr" in proc.stderr
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == before


def test_non_finite_gradients_stop_before_the_optimizer_step(train_script, tmp_path):
    cfg = _first(compose_train([*TINY, "trainer.max_steps=5", "callbacks.checkpoint.every_n_train_steps=1"], tmp_path),
                 "InfGrad", at_step=2)
    with pytest.raises(DivergenceError, match="training diverged at step 2: the gradient norm is inf"):
        train_script.run(cfg)
    good = tmp_path / "checkpoints" / LAST_GOOD
    assert _step(good) == 2  # the weights after step 2 gave a finite loss; the bad gradient was never applied
    state = torch.load(good, map_location="cpu", weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in state.values())
    assert not (tmp_path / "export").exists()


def test_non_finite_weights_after_the_last_step_are_not_exported(train_script, tmp_path):
    """The last update is checked by no later loss; the export still refuses non-finite weights."""
    train_script.run(compose_train([*TINY, "trainer.max_steps=2"], tmp_path))
    before = (tmp_path / "export" / "model.safetensors").read_bytes()
    cfg = _first(compose_train([*TINY, "trainer.max_steps=3", "overwrite=true"], tmp_path), "BlowUp", at_step=3,
                 scale=float("inf"))
    with pytest.raises(DivergenceError, match="not exporting to .*non-finite weights"):
        train_script.run(cfg)
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == before


# -- one run per name --------------------------------------------------------------------------------------------------
def test_a_second_run_with_the_same_name_is_refused_naming_the_first(train_script, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from train.safety import RunLock\n"
                               "with RunLock(sys.argv[1]):\n print('locked', flush=True); time.sleep(600)",
                               str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"another training run \\(pid {holder.pid}\\) is using"):
            train_script.run(compose_train([*TINY, "trainer.max_steps=1"], tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)  # a holder that dies leaves no stale lock behind
        holder.wait()
    train_script.run(compose_train([*TINY, "trainer.max_steps=1"], tmp_path))
    assert (tmp_path / "export" / "config.json").is_file()


def test_a_refused_second_run_leaves_the_running_runs_recipe(tmp_path):
    """Hydra wrote .hydra/config.yaml and overrides.yaml at start-up, before the lock refused the second run: the
    running run's recipe (what `scripts.tools.convert ship --recipe` ships) was replaced by the refused run's."""
    recipe = tmp_path / ".hydra"
    recipe.mkdir()
    first = {name: f"# the running run's {name}\nseed: 0\n".encode() for name in ("config.yaml", "overrides.yaml",
                                                                                  "hydra.yaml")}
    for name, content in first.items():
        (recipe / name).write_bytes(content)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from train.safety import RunLock\n"
                               "with RunLock(sys.argv[1]):\n print('locked', flush=True); time.sleep(600)",
                               str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = _cli([*TINY, "seed=1"], tmp_path, timeout=120)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert proc.returncode == 2 and f"another training run (pid {holder.pid})" in proc.stderr, proc.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in recipe.iterdir()} == first


def test_a_reused_name_is_refused_unless_resumed_or_overwritten(train_script, tmp_path):
    """A new run with a finished run's name replaced its last.ckpt and export, and training.json merged the two runs'
    epochs by number. Now it is refused; overwrite=true replaces the run, records and all."""
    smoke = ["experiment=smoke", *TINY, "trainer.max_steps=-1"]
    train_script.run(compose_train([*smoke, "trainer.max_epochs=2"], tmp_path))
    files = [tmp_path / "checkpoints" / "last.ckpt", tmp_path / "export" / "model.safetensors",
             tmp_path / "training.json", tmp_path / ".hydra" / "config.yaml"]
    before = [f.read_bytes() for f in files]
    with pytest.raises(UserError, match="holds an earlier run named 'smoke' .* Resume it with ckpt_path=last, "
                                        "give this run another name .* or replace it with overwrite=true"):
        train_script.run(compose_train([*smoke, "trainer.max_epochs=1", "seed=1"], tmp_path))
    assert [f.read_bytes() for f in files] == before  # the finished run, recipe included, as it was
    train_script.run(compose_train([*smoke, "trainer.max_epochs=1", "seed=1", "overwrite=true"], tmp_path))
    record = json.loads((tmp_path / "training.json").read_text())
    assert [e["epoch"] for e in record["epochs"]] == [0] and record["global_step"] == record["epochs"][0]["steps"]
    assert _step(files[0]) == record["global_step"]  # the new run's checkpoint, not the old one's
    assert all(f.read_bytes() != b for f, b in zip(files, before))


# -- where a run writes ------------------------------------------------------------------------------------------------
@pytest.fixture
def a_file(tmp_path) -> Path:
    """A regular file: a directory below it can never be created, even by root (chmod does not stop root)."""
    path = tmp_path / "not-a-dir"
    path.write_text("")
    return path


@pytest.mark.parametrize("key,what", [("callbacks.checkpoint.dirpath", "the checkpoints directory"),
                                      ("callbacks.export.dirpath", "the export location")])
def test_unwritable_outputs_are_found_before_the_verifier_loads(train_script, tmp_path, a_file, key, what):
    # A verifier that cannot load: the check must come first to give its own message.
    cfg = compose_train([*TINY, "verifier=hf", "verifier.path=/nonexistent/llama", f"{key}={a_file}/sub/dir"],
                        tmp_path / "run")
    with pytest.raises(UserError, match=f"{what} '{a_file}/sub") as err:
        train_script.run(cfg)
    assert "cannot be written" in str(err.value)


def test_a_run_directory_that_cannot_be_written_is_one_message(train_script, a_file):
    with pytest.raises(UserError, match="the run directory .* cannot be written"):
        train_script.run(compose_train(TINY, a_file / "run"))
    proc = _cli(TINY, a_file / "run")  # Hydra makes the directory before train.py runs: checked by a Hydra callback
    assert proc.returncode == 2 and "error: the run directory" in proc.stderr and "Traceback" not in proc.stderr


# -- resuming ----------------------------------------------------------------------------------------------------------
def test_a_truncated_checkpoint_is_one_message(train_script, tmp_path):
    train_script.run(compose_train([*TINY, "trainer.max_steps=2"], tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    with pytest.raises(UserError, match="cannot be loaded safely .* truncated, damaged"):
        train_script.run(compose_train([*TINY, "trainer.max_steps=4", "ckpt_path=last"], tmp_path))


def test_a_full_disk_while_saving_keeps_the_previous_last_checkpoint(train_script, tmp_path):
    """Lightning wrote the checkpoint to the system temp directory and moved it over `last.ckpt`; on another disk that
    move is a copy over the old file, and a full disk left a truncated `last.ckpt` in place of the good one."""
    train_script.run(compose_train([*TINY, "trainer.max_steps=2"], tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    good = last.read_bytes()
    cfg = _first(compose_train([*TINY, "trainer.max_steps=4", "ckpt_path=last"], tmp_path), "FullDisk")
    with pytest.raises(UserError, match="could not be written \\(No space left on device\\); the previous last.ckpt is "
                                        "kept. Free space in .* then resume with ckpt_path=last"):
        train_script.run(cfg)
    assert last.read_bytes() == good and _step(last) == 2
    assert not [p.name for p in last.parent.iterdir() if p.name.endswith(".tmp")]  # the partial file is gone
    train_script.run(compose_train([*TINY, "trainer.max_steps=4", "ckpt_path=last"], tmp_path))  # the advice works
    assert _step(last) == 4


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['SPECDRAFT_MARKER']}",))


def test_a_malicious_checkpoint_is_refused_without_running_its_code(train_script, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("SPECDRAFT_MARKER", str(marker))
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "global_step": 0, "x": _Payload()}, evil)
    with pytest.raises(UserError, match="cannot be loaded safely"):
        train_script.run(compose_train([*TINY, f"ckpt_path={evil}"], tmp_path / "run"))
    assert not marker.exists()


# -- bad input ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override,match", [("model.num_heads=0", "model.num_heads=0: give a whole number"),
                                            ("model.decay=0", "model.decay=0: .* above 0"),
                                            ("model.decay=-0.5", "model.decay=-0.5"),
                                            ("model.train_vocab=0", "model.train_vocab=0: give a number of tokens"),
                                            ("model.train_vocab=64 model.share_lm_head=false",
                                             "train_vocab=64 cuts the verifier's shared lm_head.*share_lm_head=false")])
def test_bad_medusa_settings_are_one_message(train_script, tmp_path, override, match):
    with pytest.raises(Exception) as err:  # Hydra's instantiate wraps it; entry points print the UserError alone
        train_script.run(compose_train([*TINY, *override.split()], tmp_path))
    assert re.search(match, str(user_error(err.value))), err.value


def test_eagle3_refuses_train_vocab(tiny):
    from hydra.utils import instantiate

    with pytest.raises(Exception) as err:
        instantiate(compose_train(["verifier=tiny", "model=eagle3", "+model.train_vocab=64"]).model, verifier=tiny)
    assert "EAGLE-3 drafts over its own head: use model.draft_vocab_size" in str(user_error(err.value))


def test_eagle_step_decay_must_be_positive(tiny):
    from hydra.utils import instantiate

    with pytest.raises(Exception) as err:
        instantiate(compose_train(["verifier=tiny", "model=eagle", "model.step_decay=0"]).model, verifier=tiny)
    assert "model.step_decay=0" in str(user_error(err.value))


@pytest.mark.parametrize("content,match", [
    (b"\x89PNG\r\n\x1a\n\x00\x00binary", "is not UTF-8 text .* looks binary"),
    (b'{"conversations": "hello"}\n', "`conversations` must be a list .* got str"),
    (b'{"conversations": [["human", "hi"]]}\n', "`conversations` must be a list .* got a list of list"),
    (b'{"messages": [{"content": "hi"}]}\n', "message 0: each message needs a `role`"),
])
def test_bad_prompt_files_are_one_message(tmp_path, content, match):
    from data.prompts import load_conversations

    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=match):
        load_conversations(str(path))


def test_a_binary_data_file_on_the_command_line(tmp_path):
    data = tmp_path / "sharegpt.json"
    data.write_bytes(bytes(range(256)) * 4)
    proc = _cli([*TINY, "data=sharegpt", f"data.source={data}"], tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is not UTF-8 text" in proc.stderr and "Traceback" not in proc.stderr


# -- settings that cannot train: refused before the verifier loads or any data is built -------------------------------
def test_a_bad_learning_rate_on_the_command_line_stops_before_any_work(tmp_path):
    """The issue's reproduction: `model.optimizer.lr=-1` ended in a traceback after the data was built."""
    proc = _cli([*TINY, "model.optimizer.lr=-1", f"cache_dir={tmp_path / 'cache'}"], tmp_path / "run", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: model.optimizer.lr=-1: give a learning rate of 0 or more, e.g. model.optimizer.lr=1e-3."]
    assert not (tmp_path / "cache").exists()  # no verifier cache, no data built
    assert not {".hydra", ".lock", "checkpoints"} & {p.name for p in (tmp_path / "run").iterdir()}


@pytest.mark.parametrize("override,match", [
    ("data.batch_size=0", "data.batch_size=0: give a whole number of sequences >= 1, e.g. data.batch_size=8."),
    ("model.optimizer.lr=abc", "model.optimizer.lr='abc': give a learning rate of 0 or more"),
    ("model.optimizer.weight_decay=-0.1", "model.optimizer.weight_decay=-0.1: give a weight decay of 0 or more"),
    ("model.warmup_ratio=1.5", "model.warmup_ratio=1.5: give a fraction of the steps in \\[0, 1\\]"),
    ("data.val_fraction=1.0", "data.val_fraction=1.0: give a fraction in \\[0, 1\\)"),
    ("data.max_new_tokens=0", "data.max_new_tokens=0: give a whole number of tokens >= 1"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0: give a whole number of epochs >= 1"),
    ("trainer.max_steps=0", "trainer.max_steps=0: give a whole number of steps >= 1, or -1"),
    ("+trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0: give a whole number of batches >= 1"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1: give a norm of 0 or more, or null"),
    ("callbacks.checkpoint.every_n_train_steps=-5", "callbacks.checkpoint.every_n_train_steps=-5: give a whole"),
    ("trainer.max_epochs=-1", "trainer.max_epochs=-1 with trainer.max_steps=-1 never stops"),
])
def test_bad_numbers_are_one_message_before_any_work(train_script, tmp_path, override, match):
    with pytest.raises(UserError, match=match):
        train_script.run(compose_train([*TINY, "verifier=hf", "verifier.path=/nonexistent/llama", override],
                                       tmp_path / "run"))  # a verifier that cannot load: the check comes first
    assert not (tmp_path / "run").exists()

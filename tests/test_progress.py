"""Training progress a person can follow in a log: the real command line with stdout to a pipe (not a terminal) prints
one plain line every `callbacks.progress.every_steps` optimizer steps and one for the last step (train/progress.py)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from runtime.errors import UserError
from train.progress import LogProgress

TINY = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
        "data.val_fraction=0.25", "logger=csv", "trainer.log_every_n_steps=1", "trainer.max_epochs=3",
        "callbacks.progress.every_steps=4", "callbacks.progress.every_seconds=3600"]  # 3 batches an epoch: 9 steps
LINE = re.compile(r"^step (\d+)/(\d+)  loss (\d+\.\d{3})  assistant tok/s (\d+)  elapsed (\d+s|\d+m\d\ds|\d+h\d\dm)"
                  r"  eta (\d+s|\d+m\d\ds|\d+h\d\dm)$")


def _train(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "train.py", *TINY, *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_progress_lines_in_a_log(tmp_path):
    """Lines at steps 4 and 8 (every_steps), then the last step (9, the run's total), each with the loss the module
    logged at that step (the CSV logger's row; Lightning numbers it from 0)."""
    proc = _train([], tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    matches = [LINE.match(line) for line in lines]
    assert lines and all(matches), lines
    steps = [int(m[1]) for m in matches]
    assert steps == [4, 8, 9] and {int(m[2]) for m in matches} == {9}, lines
    assert all(int(m[4]) > 0 for m in matches), lines  # assistant tokens were counted
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        logged = {int(r["step"]) + 1: float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert [float(m[3]) for m in matches] == [round(logged[s], 3) for s in steps], (lines, logged)


def test_progress_when_never_prints_no_line(tmp_path):
    proc = _train(["callbacks.progress.when=never", "trainer.max_epochs=1"], tmp_path)
    assert "export:" in proc.stdout and not [line for line in proc.stdout.splitlines() if line.startswith("step ")]


def test_an_unknown_when_is_refused_with_the_choices():
    with pytest.raises(UserError, match=r"callbacks.progress.when='sometimes': use one of auto, always, never"):
        LogProgress(when="sometimes")

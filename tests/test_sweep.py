"""Hydra multirun: `python train.py -m` gives one run directory per job under outputs/<name>-sweep/, and
scripts/tools/sweep_table.py tabulates the grid from the jobs' overrides and exports."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT

TINY = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
        "data.val_fraction=0.25", "logger=csv", "model=eagle", "trainer.max_epochs=1"]


def test_multirun_grid_one_directory_per_job_and_the_table(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "train.py", "-m", *TINY, "model.optimizer.lr=0.001,0.03",
                           f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job, lr in (("0", "0.001"), ("1", "0.03")):
        config = json.loads((sweep / job / "export" / "config.json").read_text())
        assert config["trained_steps"] >= 2 and "val_step_top1" in config
        assert f"model.optimizer.lr={lr}" in (sweep / job / ".hydra" / "overrides.yaml").read_text()
    (sweep / "2" / ".hydra").mkdir(parents=True)  # a job that never exported is listed, not dropped
    same = (sweep / "0" / ".hydra" / "overrides.yaml").read_text().replace("lr=0.001", "lr=1.0")
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text(same)
    out = subprocess.run([sys.executable, "-m", "scripts.tools.sweep_table", str(sweep)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads((sweep / "sweep.json").read_text())
    assert [r["overrides"]["model.optimizer.lr"] for r in rows] == ["0.001", "0.03", "1.0"]
    assert [r["status"] for r in rows] == ["done", "done", "no export (running or failed)"]
    assert all(len(r["depth_top1"]) == 5 and 0 <= r["train_depth1_top1"] <= 1 for r in rows[:2])
    md = (sweep / "sweep.md").read_text()
    assert "| job | model.optimizer.lr | top-1 d1 |" in md  # only the swept key is a column
    assert md.count("\n| ") == 3  # 3 jobs under the header
    assert md.index("| 1 | 0.03 |") < md.index("| 0 | 0.001 |")  # best depth-1 accuracy first (lr 0.001: 3 steps)
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = subprocess.run([sys.executable, "-m", "scripts.tools.sweep_table", str(empty)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "no Hydra jobs" in bad.stderr


def test_sweeps_land_under_outputs_name_sweep():
    proc = subprocess.run([sys.executable, "train.py", "--cfg", "hydra"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dir: outputs/${name}-sweep\n    subdir: ${hydra.job.num}" in proc.stdout

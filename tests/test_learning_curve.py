"""scripts/studies/learning_curve.py end to end on tiny exports: tau per node budget, exactness, chain accuracy,
outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from helpers import ROOT, varied_llama
from models.eagle import build_eagle
from models.exports.io import save_export
from models.medusa import MedusaHeads


def test_learning_curve_script_writes_table_plot_and_exact_taus(tmp_path):
    v = varied_llama()
    torch.manual_seed(0)
    save_export(build_eagle("eagle", v), v, tmp_path / "eagle", {"train_tokens": 1000})
    heads = MedusaHeads(v.hidden_size, v.vocab_size, num_heads=2)
    table = [[0.5, 0.7, 0.8], [0.3, 0.5, 0.6]]  # per-head top-k accuracies, which tree=auto builds from
    save_export(heads, v, tmp_path / "medusa", {"train_tokens": 4000, "medusa_topk_accuracy": table})
    # Their runs' training.json: beside the export folder (a run's), or inside it (a shipped export's)
    (tmp_path / "training.json").write_text(json.dumps({"epochs": [
        {"epoch": 0, "wall_s": 10.0, "resumed": True}, {"epoch": 1, "wall_s": 20.0}, {"epoch": 2, "wall_s": 30.0}]}))
    (tmp_path / "medusa" / "specdraft").mkdir(exist_ok=True)
    (tmp_path / "medusa" / "specdraft" / "training.json").write_text(
        json.dumps({"epochs": [{"epoch": 0, "wall_s": 7.0}]}))
    env = {**os.environ, "WANDB_MODE": "disabled"}

    def run(export: str, out, *extra: str) -> None:
        proc = subprocess.run([sys.executable, "-m", "scripts.studies.learning_curve", str(tmp_path / export),
                               "--tree-sizes", "3", "6", "--num-prompts", "3", "--max-new-tokens", "12", "--depth", "3",
                               "--cache-dir", str(tmp_path / "cache"), "--out", str(out), *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run("eagle", tmp_path / "first")  # a curve built export by export: the second run includes the first's rows
    out = tmp_path / "curve"
    run("medusa", out, "--include", str(tmp_path / "first" / "learning_curve.json"))
    rows = json.loads((out / "learning_curve.json").read_text())
    assert sorted((r["drafter"], r["train_tokens"]) for r in rows) == [("EAGLE-1", 1000), ("Medusa", 4000)]
    for r in rows:
        assert set(r["tau"]) == {"3", "6"} and all(t >= 1.0 for t in r["tau"].values())
        assert all(m == 1.0 for m in r["greedy_match"].values())  # exact against plain greedy
        assert len(r["chain_accuracy"]) == (2 if r["drafter"] == "Medusa" else 3)  # Medusa: as deep as its 2 heads
        assert all(0.0 <= a <= 1.0 for a in r["chain_accuracy"])
        assert 1 / v.vocab_size < r["verifier_top1"] <= 1.0  # the ceiling indicator, same verifier for both runs
    assert rows[0]["verifier_top1"] == rows[1]["verifier_top1"]
    record = {r["drafter"]: (r["epochs"], r["wall_s_per_epoch"]) for r in rows}
    assert record == {"EAGLE-1": (3, 25.0), "Medusa": (1, 7.0)}  # a resumed epoch's part-time is left out
    assert (out / "learning_curve.png").stat().st_size > 0
    table = (out / "learning_curve.md").read_text()
    assert "| EAGLE-1 | 1,000 |" in table and "| Medusa | 4,000 |" in table and "| 3 | 25 |" in table
    assert all(line.count("|") == table.splitlines()[0].count("|")
               for line in table.splitlines() if line.startswith("|"))
    assert f"(T=1): {rows[0]['verifier_top1']:.3f}" in table
    merged = tmp_path / "merged"  # no exports: only merge curves run apart (e.g. one per machine core)
    proc = subprocess.run([sys.executable, "-m", "scripts.studies.learning_curve", "--tree-sizes", "3", "6",
                           "--depth", "3", "--out", str(merged),
                           "--include", str(tmp_path / "first" / "learning_curve.json"),
                           str(out / "learning_curve.json")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_export = lambda rs: sorted(rs, key=lambda r: r["export"])
    assert by_export(json.loads((merged / "learning_curve.json").read_text())) == by_export(rows)  # each export once
    assert (merged / "learning_curve.md").read_text() == table


def test_the_fitted_limit_recovers_a_known_law():
    """tau = 2.8 - 0.6 (N / 2.6M)^-0.35 at four token counts (with +-0.01 wiggle): the fit finds its limit; three
    points are too few for three parameters."""
    from scripts.studies.learning_curve import fit_limit

    law = lambda n: 2.8 - 0.6 * (n / 2.6e6) ** -0.35  # noqa: E731
    pts = [(n, law(n) + d) for n, d in zip((1.6e5, 3.3e5, 6.5e5, 2.6e6), (0.01, -0.01, 0.01, -0.01))]
    fit = fit_limit(pts)
    assert abs(fit["limit"] - 2.8) < 0.1 and abs(fit["b"] - 0.35) < 0.1 and fit["rms_residual"] < 0.02
    assert fit["saturating"]
    import math  # a log-linear curve (as Medusa's on the shipped set): no limit in sight, and the fit says so
    loglin = fit_limit([(n, 1.43 + 0.1 * math.log(n / 1.6e5)) for n, _ in pts])
    assert loglin is not None and not loglin["saturating"]
    assert fit_limit(pts[:3]) is None
    flat = fit_limit([(n, 1.5) for n, _ in pts])  # no gain from more data: the limit is where it already is
    assert abs(flat["limit"] - 1.5) < 0.05

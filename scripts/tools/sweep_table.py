"""The grid of a Hydra multirun sweep of train.py, one row per job: what it swept and what the export measured.

    python train.py -m model=eagle data.cache_hidden_states=true model.optimizer.lr=3e-4,1e-3,3e-3 \
        trainer.max_epochs=1,3
    python -m scripts.tools.sweep_table outputs/eagle-smollm2-sweep

Columns: the overrides that differ between jobs (read from each job's .hydra/overrides.yaml), then the validation
figures the export carries: for EAGLE drafters the unrolled per-step top-1 (`val_step_top1`, step 1 = depth 1) and
`estimated_tau`; for Medusa each head's top-1 (`medusa_topk_accuracy[k][0]`); the last epoch's depth-1 training
accuracy (`train_depth1_top1`: the train/held-out gap); the steps trained. A job without an
export (still running, failed) is listed as such. Writes sweep.md and sweep.json in the sweep directory and prints
the table; the whole grid is reported, best first by depth-1 accuracy, never only the winner.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def job_row(job: Path) -> dict[str, Any]:
    overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
    row: dict[str, Any] = {"job": job.name, "overrides": dict(o.split("=", 1) for o in overrides if "=" in o)}
    config_path = job / "export" / "config.json"
    if not config_path.is_file():
        row["status"] = "no export (running or failed)"
        return row
    config = json.loads(config_path.read_text())
    row["status"] = "done"
    row["trained_steps"] = config.get("trained_steps")
    row["train_tokens"] = config.get("train_tokens")
    row["train_depth1_top1"] = config.get("train_depth1_top1")
    if "val_step_top1" in config:
        row["depth_top1"] = [float(x) for x in config["val_step_top1"]]
        row["estimated_tau"] = config.get("estimated_tau")
    elif "medusa_topk_accuracy" in config:
        row["depth_top1"] = [float(head[0]) for head in config["medusa_topk_accuracy"]]
    return row


def table(rows: list[dict[str, Any]], depth: int = 3) -> list[str]:
    keys = sorted({k for r in rows for k in r["overrides"]})
    swept = [k for k in keys if len({r["overrides"].get(k) for r in rows}) > 1]
    head = ["job", *swept, *(f"top-1 d{d + 1}" for d in range(depth)), "train d1", "est. tau", "steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(rows, key=lambda r: -(r.get("depth_top1") or [-1.0])[0])
    for r in order:
        accs = r.get("depth_top1") or []
        cells = [r["job"], *(r["overrides"].get(k, "") for k in swept)]
        if r["status"] != "done":
            cells += [r["status"]] + [""] * (depth + 2)
        else:
            cells += [f"{accs[d]:.3f}" if d < len(accs) else "" for d in range(depth)]
            train = r.get("train_depth1_top1")
            cells += [f"{train:.3f}" if train is not None else ""]
            cells += [f"{r['estimated_tau']:.2f}" if r.get("estimated_tau") is not None else "",
                      str(r["trained_steps"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir")
    ap.add_argument("--depth", type=int, default=3, help="depths shown")
    args = ap.parse_args()
    sweep = Path(args.sweep_dir)
    jobs = sorted((p for p in sweep.iterdir() if (p / ".hydra" / "overrides.yaml").is_file()),
                  key=lambda p: (len(p.name), p.name))
    if not jobs:
        raise SystemExit(f"error: no Hydra jobs under {sweep} (expected <job>/.hydra/overrides.yaml, as "
                         f"`python train.py -m ...` writes them under outputs/<name>-sweep/)")
    rows = [job_row(j) for j in jobs]
    lines = table(rows, args.depth)
    (sweep / "sweep.json").write_text(json.dumps(rows, indent=2))
    (sweep / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {sweep}/sweep.md, sweep.json")


if __name__ == "__main__":
    main()

"""Several exported drafters, one table: tau and speedup of each on the same prompts, in one process.

    python -m scripts.tools.compare_drafters outputs/medusa-smollm2/export outputs/eagle-smollm2/export \
        outputs/eagle3-smollm2/export -- num_prompts=10 max_new_tokens=96

Everything after `--` is a `python -m eval` override applied to every run (tree=..., threads=..., prompts=...).
Each run writes its own report under <output_dir>/<n>-<name>/; the table is also saved as comparison.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from eval.harness import evaluate

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str]) -> None:
    split = argv.index("--") if "--" in argv else len(argv)
    checkpoints, overrides = argv[:split], argv[split + 1 :]
    if not checkpoints:
        raise SystemExit(__doc__)
    out = ROOT / "outputs" / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    rows = []
    for i, ckpt in enumerate(checkpoints):
        name = Path(ckpt).resolve().parent.name
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            cfg = compose("eval", overrides=[f"checkpoint={ckpt}", f"output_dir={out / f'{i}-{name}'}", *overrides])
        report = evaluate(cfg)
        rows.append({"run": name, **{k: report[k] for k in (
            "method", "num_prompts", "new_tokens", "tau", "accept_rate_per_position", "tokens_per_s",
            "baseline_tokens_per_s", "hf_generate_tokens_per_s", "hf_prompt_lookup_tokens_per_s", "speedup",
            "speedup_vs_hf_generate", "greedy_match")}})
    (out / "comparison.json").write_text(json.dumps(rows, indent=2))
    table = Table(title=f"drafters on the same prompts ({' '.join(overrides) or 'defaults'})")
    for col in ("run", "method", "tau", "alpha_1..", "tok/s", "plain tok/s", "HF tok/s", "HF lookup tok/s",
                "speedup", "vs HF", "greedy match"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["run"], r["method"], f"{r['tau']:.2f}",
                      " ".join(f"{a:.2f}" for a in r["accept_rate_per_position"][:5]),
                      f"{r['tokens_per_s']:.1f}", f"{r['baseline_tokens_per_s']:.1f}",
                      f"{r['hf_generate_tokens_per_s']:.1f}", f"{r['hf_prompt_lookup_tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['speedup_vs_hf_generate']:.2f}x", f"{r['greedy_match']:.0%}")
    Console(width=200).print(table)
    print(f"comparison: {out / 'comparison.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])

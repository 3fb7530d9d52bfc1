"""When a GPU is at hand: train EAGLE-3 for the default verifier on CUDA for a few hundred steps (the path
experiment=gpu_8b takes for an 8B verifier: trainer, data module, export), evaluate the export on CUDA and on this
machine's CPU with the same prompts, and print the figures side by side.

    python -m scripts.tools.gpu_check                       # 300 steps, 20 eval prompts
    python -m scripts.tools.gpu_check --steps 500 --devices 2 --strategy ddp

Without a CUDA device it says so and exits with status 2; the tests never need a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("tau", "tokens_per_s", "baseline_tokens_per_s", "speedup", "speedup_vs_hf_generate", "greedy_match")


def _run(cmd: list[str]) -> float:
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", choices=("gpu", "ddp", "fsdp"), default="gpu")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--out", default="outputs/gpu-check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device here (torch.cuda.is_available() is False): nothing was run. Run this on a "
              "machine with a GPU and a CUDA build of torch.", file=sys.stderr)
        return 2
    out = (ROOT / args.out).resolve()
    train_s = _run([sys.executable, "train.py", "model=eagle3", f"trainer={args.strategy}",
                    f"trainer.devices={args.devices}", "trainer.accelerator=gpu", f"trainer.max_steps={args.steps}",
                    "trainer.max_epochs=1000", f"data.batch_size={args.batch_size}", "logger=csv",
                    f"hydra.run.dir={out / 'train'}"])
    export = out / "train" / "export"
    reports = {}
    for device in ("cuda", "cpu"):
        _run([sys.executable, "-m", "eval", f"checkpoint={export}", f"device={device}",
              f"num_prompts={args.num_prompts}", "wandb.mode=disabled",
              f"output_dir={out / ('eval-' + device)}"])
        reports[device] = json.loads((out / f"eval-{device}" / "report.json").read_text())
    config = json.loads((export / "config.json").read_text())
    print(f"\nEAGLE-3, {args.steps} steps on {torch.cuda.get_device_name(0)} ({args.devices} device(s), "
          f"{args.strategy}): {train_s / 60:.1f} min of training and data, {config.get('train_tokens')} training "
          f"tokens, estimated tau {config.get('estimated_tau')}")
    print(f"{'':26}{'cuda':>12}{'cpu':>12}")
    for key in ROWS:
        print(f"{key:26}" + "".join(f"{str(reports[d].get(key)):>12}" for d in ("cuda", "cpu")))
    (out / "gpu_check.json").write_text(json.dumps({"steps": args.steps, "train_seconds": train_s,
                                                    "reports": reports}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

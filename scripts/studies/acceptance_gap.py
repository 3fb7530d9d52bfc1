"""Where a drafter's acceptance goes between training and use: the same first-position acceptance measured five ways.

    python -m scripts.studies.acceptance_gap pretrained/eagle3-smollm2 pretrained/medusa-smollm2 \
        pretrained/dflash-smollm2 --prompts builtin humaneval --num-prompts 12 --vllm

For each export, alpha_k (the fraction of chain rounds whose k-th draft is accepted, k = 1..depth):

1. `val, positions`: teacher-forced on its own training run's held-out rows (the recipe's data, `val_fraction` and
   seed), over every answer position: what training's `val/step0_top1` promised.
2. `unseen, positions`: teacher-forced on the verifier's greedy answers to prompts no one trained on.
3. `unseen, rounds`: the same answers, but only at the positions where a simulated chain decode starts its rounds
   (eval/offline.py `round_leads`): rounds start just after the drafter failed, which is not an average position.
4. `ours, live`: `python -m eval tree=chain drafter=export` on the same prompts and the verifier's dtype given.
5. `vLLM, live`: the real vLLM (its CPU build, `engine_peers=[vllm]`) on the same prompts, drafting as many tokens.

So 1 -> 2 is the distribution shift (the prompts), 2 -> 3 the rounds' selection of positions, 3 -> 4 what live
decoding adds (the drafter's own earlier drafts and its cache, the states as our engine computes them), 4 -> 5 the
serving engine. Teacher-forced figures use the verifier in float32 (its exact greedy answers); `--dtype` sets the
live runs' (eval's `dtype=`). Writes acceptance_gap.json and acceptance_gap.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from data.prompts import load_prompt_sets
from data.selfdistill import build_selfdistill
from eval.offline import first_answer_tokens, score_export
from models.exports.io import export_verifier, load_export, read_config
from models.verifiers.core import Verifier
from models.verifiers.load import load_verifier
from runtime.errors import UserError, exit_on_user_error

ROOT = Path(__file__).resolve().parents[2]


def val_rows(export: Path, verifier: Verifier, limit: int, window: int) -> list[dict[str, Any]]:
    """The held-out rows of the run that trained `export` (its recipe's data settings, hidden states from the
    verifier's own forward), cut to their first `window` answer tokens; the first `limit` of them."""
    recipe_file = export / "specdraft" / "recipe.yaml"
    if not recipe_file.is_file():
        raise UserError(f"{export} has no {recipe_file.relative_to(export)}: the held-out split of its training run "
                        f"cannot be rebuilt. Give an export written by train.py.")
    recipe = OmegaConf.load(recipe_file)
    data = OmegaConf.to_container(recipe.data, resolve=False)
    assert isinstance(data, dict)
    data |= {"cache_hidden_states": False, "seed": int(recipe.get("seed", 0)),
             "cache_dir": os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")}
    datamodule = instantiate(OmegaConf.create(data), verifier=verifier)
    _, held_out = datamodule.split(datamodule.build())
    rows = list(held_out.with_format("python"))[:limit]
    return [first_answer_tokens(r, window) for r in rows]


def teacher_forced(export: Path, verifier: Verifier, rows: list[dict[str, Any]], depth: int) -> dict[str, Any]:
    loaded = load_export(export, verifier)
    return score_export(loaded.kind, loaded.net, verifier, rows, depth, keep=loaded.train_ids) | {"kind": loaded.kind}


def live(export: Path, prompts_file: Path, depth: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """`python -m eval` as a user runs it: a chain of `depth` drafts on the same prompts (and vLLM beside it)."""
    cmd = [sys.executable, "-m", "eval", f"checkpoint={export}", "drafter=export", "tree=chain",
           f"tree.depth={depth}", f"prompts={prompts_file}", "num_prompts=null",
           f"max_new_tokens={args.max_new_tokens}", f"dtype={args.dtype}", f"threads={args.threads}",
           "alone=false", "warmup=false", "wandb.mode=disabled", f"output_dir={out}"]
    if args.vllm:
        cmd += ["engine_peers=[vllm]", f"engine_peer_tokens={depth}"]
    print("[gap]", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads((out / "report.json").read_text())


def measure(export: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    config = read_config(export)
    verifier = load_verifier(export_verifier(config, export / "config.json"), "float32", "cpu", args.cache_dir)
    depth = args.depth
    convs = load_prompt_sets(args.prompts if len(args.prompts) > 1 else args.prompts[0], args.num_prompts)
    prompts_file = out / "prompts.jsonl"
    with prompts_file.open("w") as f:
        for c in convs:
            f.write(json.dumps({"prompt": c.user_turns[0], "category": c.category}) + "\n")
    answers = list(build_selfdistill(verifier, convs, args.cache_dir, max_new_tokens=args.max_new_tokens,
                                     batch_size=8).with_format("python"))
    held_out = val_rows(export, verifier, args.val_rows, args.max_new_tokens)
    val = teacher_forced(export, verifier, held_out, depth)
    unseen = teacher_forced(export, verifier, answers, depth)
    del verifier
    report = live(export, prompts_file, depth, args, out / "eval")
    row: dict[str, Any] = {
        "export": str(export), "kind": val["kind"], "depth": depth, "prompts": len(convs),
        "val_rows": len(held_out),
        "val_positions": _absolute(val["chain_conditional"]),
        "unseen_positions": _absolute(unseen["chain_conditional"]),
        "unseen_rounds": unseen["round_accept_per_position"],
        "ours_live": report["accept_rate_per_position"][:depth],
        "tau": {"val_rounds": val["tau_rounds"], "unseen_rounds": unseen["tau_rounds"], "ours_live": report["tau"]},
        "greedy_match": report["greedy_match"],
    }
    vllm = (report.get("engine_peers") or {}).get("vllm") or {}
    spec = vllm.get("speculative") or {}
    if spec:
        row["vllm_live"] = list(spec.get("accept_rate_per_position") or [])[:depth]
        row["tau"]["vllm_live"] = spec.get("tau")
    return row


def _absolute(conditional: list[float]) -> list[float]:
    """P(depths 1..k all right) from the chain's conditional accuracies: alpha_k as the decode loop counts it."""
    out, p = [], 1.0
    for c in conditional:
        p *= c
        out.append(p)
    return out


STAGES = (("val_positions", "1. val, positions"), ("unseen_positions", "2. unseen, positions"),
          ("unseen_rounds", "3. unseen, rounds"), ("ours_live", "4. ours, live"), ("vllm_live", "5. vLLM, live"))


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| export | " + " | ".join(name for _, name in STAGES) + " | shift (1-2) | rounds (2-3) | live (3-4) "
             "| engine (4-5) |", "|---" * (len(STAGES) + 5) + "|"]
    for r in rows:
        first = [r[k][0] if r.get(k) else None for k, _ in STAGES]
        cells = [f"{a:.3f}" if a is not None else "" for a in first]
        gaps = [f"{a - b:+.3f}" if a is not None and b is not None else "" for a, b in zip(first, first[1:])]
        lines.append(f"| {Path(r['export']).name} | " + " | ".join(cells + gaps) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+")
    ap.add_argument("--prompts", nargs="+", default=["builtin", "humaneval"])
    ap.add_argument("--num-prompts", type=int, default=12, help="from each prompt set (round-robin by category)")
    ap.add_argument("--val-rows", type=int, default=48, help="held-out rows of the training run scored")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="the live runs' verifier dtype (eval's dtype=)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="add the real vLLM (its venv: setup.sh) beside ours")
    ap.add_argument("--cache-dir", default=os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft"))
    ap.add_argument("--out", default="outputs/acceptance_gap")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def run() -> None:
        out = Path(args.out)
        if (out / "acceptance_gap.json").exists():
            raise UserError(f"--out {out} already holds acceptance_gap.json: give a new folder, so no earlier "
                            f"measurement is overwritten.")
        rows = []
        for export in map(Path, args.exports):
            where = out / export.name
            where.mkdir(parents=True, exist_ok=True)
            rows.append(measure(export, args, where))
            (out / "acceptance_gap.json").write_text(json.dumps(rows, indent=2))  # each export kept as it ends
            print(table(rows), flush=True)
        (out / "acceptance_gap.md").write_text(table(rows) + "\n")
        print(f"written: {out / 'acceptance_gap.json'}, {out / 'acceptance_gap.md'}")

    exit_on_user_error(run)


if __name__ == "__main__":
    main()

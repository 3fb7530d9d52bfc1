"""Medusa heads against a truncated-verifier draft model distilled from the same self-distilled data: acceptance
compared by real greedy speculative decoding, chains of the same depth.

    python train.py model=medusa && python train.py model=draft_model       # both on the default data
    python -m scripts.studies.medusa_vs_draft_model --threads 1 --num-prompts 10 --max-new-tokens 64

Three drafters, each proposing a chain of --depth tokens that one verifier forward checks: the Medusa export (each
head's top-1), the distilled draft model (its own argmax, token after token, with its own KV cache), and as a
baseline the untrained truncated copy of the verifier with as many layers as the distilled one. They decode the
built-in eval split (never trained on) interleaved per prompt with our plain greedy decoding (eval.report's
eval.runner.Runner, driven by eval.runner.run_prompts), in --dtype (default float32). Printed per drafter: tau (tokens
per verifier forward, bonus included), alpha_k (fraction of rounds whose k-th draft was accepted), tokens/s against
plain greedy and whether the output equals plain greedy's. Writes medusa_vs_draft_model.json and .png to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from data.prompts import load_conversations, select_prompts
from eval.drafters.build import make_drafter
from eval.drafters.draft_model import make_draft_model_drafter
from eval.engine.acceptance.protocol import per_position_acceptance
from eval.engine.tree import Chain
from eval.report import rows
from eval.runner import Runner, run_prompts
from models.draft_model import read_draft_info
from models.exports.io import export_verifier, read_config
from models.verifiers.core import default_cache_dir
from models.verifiers.load import load_verifier
from runtime.errors import UserError, exit_on_user_error
from scripts.common import save_figure, subplots


def save_chart(methods: dict[str, dict], depth: int, title: str, path: Path) -> Path:
    fig, ax = subplots(figsize=(6.4, 3.8))
    width = 0.8 / len(methods)
    for i, (name, row) in enumerate(methods.items()):
        xs = [k + 1 + (i - (len(methods) - 1) / 2) * width for k in range(depth)]
        bars = ax.bar(xs, row["alpha"], width, label=f"{name}: tau {row['tau']:.2f}")
        for bar, a in zip(bars, row["alpha"]):
            ax.annotate(f"{a:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=6)
    ax.set(xlabel="draft position k", ylabel="alpha_k: rounds whose k-th draft was accepted", title=title,
           xticks=range(1, depth + 1), ylim=(0, 1))
    ax.legend(fontsize=7)
    save_figure(fig, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--medusa", default="outputs/medusa-smollm2/export", help="Medusa export (train.py model=medusa)")
    ap.add_argument("--draft-model", default="outputs/draft_model-smollm2/export",
                    help="distilled draft model export (train.py model=draft_model)")
    ap.add_argument("--depth", type=int, default=4, help="draft tokens per round, for every drafter")
    ap.add_argument("--num-prompts", type=int, default=10, help="built-in eval prompts, round-robin over categories")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default=str(default_cache_dir()))
    ap.add_argument("--out", default="outputs/medusa_vs_draft_model")
    args = ap.parse_args()
    exit_on_user_error(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    medusa, draft = Path(args.medusa).expanduser(), Path(args.draft_model).expanduser()
    info = read_draft_info(draft)
    if info is None:
        raise UserError(f"--draft-model {str(draft)!r} is not a draft model exported by python train.py "
                        f"model=draft_model (no specdraft_draft_model.json there).")
    source = export_verifier(read_config(medusa))
    verifier = load_verifier(source, args.dtype, "cpu", args.cache_dir)
    layers = int(info["num_hidden_layers"])
    drafters = {  # each refuses an export made for another verifier
        f"medusa ({args.depth} heads' top-1)": make_drafter("medusa", verifier, Chain(args.depth), checkpoint=medusa),
        f"draft model, distilled ({layers} layers)": make_draft_model_drafter(verifier, Chain(args.depth),
                                                                                path=str(draft)),
        f"draft model, untrained ({layers} layers)": make_draft_model_drafter(verifier, Chain(args.depth),
                                                                                layers=layers),
    }
    convs = select_prompts(load_conversations("builtin", split="eval"), args.num_prompts)
    runner = Runner(verifier, drafters, args.max_new_tokens, lookup=10)
    samples = run_prompts(runner, convs, multi_turn=False, warmup=True)
    table = rows(samples, list(drafters))
    methods = {}
    for name in drafters:
        lengths = torch.cat([s.lengths[name] for s in samples])
        methods[name] = {**table[name], "rounds": int(lengths.numel()),
                         "alpha": [round(a, 4) for a in per_position_acceptance(lengths, args.depth).tolist()]}
    report = {"verifier": verifier.name, "medusa_export": str(medusa), "draft_model_export": str(draft),
              "draft_model_trained_steps": info.get("trained_steps"), "draft_model_val_top1": info.get("val_top1"),
              "draft_model_val_kl": info.get("val_kl"), "depth": args.depth, "num_prompts": len(samples),
              "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "threads": args.threads,
              "baseline_tokens_per_s": table["baseline"]["tokens_per_s"], "methods": methods}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "medusa_vs_draft_model.json").write_text(json.dumps(report, indent=2))
    chart = save_chart(methods, args.depth, f"{verifier.name}: chains of {args.depth}, {len(samples)} eval prompts",
                       out / "medusa_vs_draft_model.png")
    print(f"{'drafter':<38} {'tau':>5} " + " ".join(f"{f'a{k + 1}':>5}" for k in range(args.depth))
          + f" {'speedup':>8} {'exact':>6}")
    for name, r in methods.items():
        print(f"{name:<38} {r['tau']:5.2f} " + " ".join(f"{a:5.2f}" for a in r["alpha"])
              + f" {r['speedup']:7.2f}x {r['greedy_match']:6.0%}")
    print(f"plain greedy: {table['baseline']['tokens_per_s']:.1f} tok/s; json: {out / 'medusa_vs_draft_model.json'}, "
          f"chart: {chart}")


if __name__ == "__main__":
    main()

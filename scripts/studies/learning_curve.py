"""The learning curve: tau and teacher-forced chain accuracy of drafters trained on more and more verifier tokens.

    python -m scripts.studies.learning_curve outputs/eagle-40k/export outputs/eagle-250k/export ... \
        --tree-sizes 16 24 --num-prompts 20 --max-new-tokens 128 --out outputs/learning_curve

Every export is decoded greedily on the same built-in eval prompts (never trained on) with the verifier in float32,
once per node budget (`tree=auto` of that size: the same budget for every drafter), and its output is checked
against plain greedy decoding token for token. tau is pooled over all rounds of all prompts (tokens per verifier
forward). Chain accuracy per depth is teacher-forced on the verifier's own answers to the same prompts
(eval/offline.py's tables, as scripts/tools/drafter_accuracy.py prints them: P(depth d right | depths 1..d-1 right)).
The training-token count of each export is its config's `train_tokens` (assistant tokens in its training split), or
`--tokens`. Beside them, the verifier's mean top-1 probability on its own answers (eval.offline.verifier_top1): a
ceiling indicator; and the export's `train_depth1_top1` (its last epoch's depth-1 accuracy on training batches): next to
acc d1, the gap. From the run's training.json (train/record.py): its epochs and wall seconds per epoch on the machine
that trained it. Where a curve has 4+ points, the limit it points to: tau = limit - a N^-b fitted (scipy), drawn dashed
out to 10x.

Writes learning_curve.json, learning_curve.md (the table) and learning_curve.png (tau against training tokens, one
line per drafter family and budget), and logs the table and plot to W&B (offline unless an account is configured).

Along training, side by side (Muon against AdamW, DFlash2 against DFlash: docs/results/muon.md):

    python -m scripts.studies.learning_curve --runs outputs/e3-adamw-s0 outputs/e3-adamw-s1 outputs/e3-muon-s0 ... \
        --prompts builtin humaneval --chain 3 --tree-sizes 8 --out outputs/muon_curve

`--runs`: training run directories (logger=csv); their exports are decoded as above, and their validation top-1 per
depth at every validation (`val/step{j}_top1`, the curve along training) is tabulated per group of seeds (a run's
group is its directory name without a trailing `-s<seed>`): the mean and the seeds' range, and for each group the
first step whose mean depth-1 top-1 reaches each other group's final one (training_curve.md / .json).
`--prompts`: the sources decoded (`builtin`: its eval split; `humaneval`; a .jsonl file), `--num-prompts` from each.
`--chain K`: also decode with a chain of K drafts and record the acceptance per position (alpha_k, pooled rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from data.chat import prompt_ids
from data.prompts import load_conversations, select_prompts
from data.selfdistill import build_selfdistill
from eval.drafters.build import make_drafter
from eval.engine.acceptance.protocol import mean_accept_length, per_position_acceptance
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import AutoTree, Chain
from eval.offline import score_export, verifier_top1
from models.exports.io import export_kind, export_verifier, load_export, read_config
from models.families import title
from models.verifiers.load import load_verifier
from scripts.common import save_figure, subplots

MIN_SATURATING_B = 0.05  # a fitted exponent below this: the curve is about log-linear over its range, no limit


def fit_limit(points: list[tuple[float, float]]) -> dict[str, float] | None:
    """The limit a learning curve points to: tau(N) = limit - a * N^-b fitted (least squares, a > 0, 0 < b < 2,
    limit at least the best point) to (training tokens N, tau) points; None below 4 points (3 parameters need one
    point to spare) or when the fit fails. Indicative: an extrapolation, not a measurement."""
    if len(points) < 4:
        return None
    import numpy as np
    from scipy.optimize import curve_fit

    n, tau = np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)
    scale = n.max()  # fit on N / max(N): a well-conditioned problem at any token count
    law = lambda x, limit, a, b: limit - a * x ** (-b)  # noqa: E731
    try:
        (limit, a, b), _ = curve_fit(law, n / scale, tau, p0=(tau.max() + 0.1, 0.1, 0.5),
                                     bounds=([tau.max(), 0.0, 1e-3], [tau.max() + 10.0, 10.0, 2.0]), maxfev=20000)
    except (RuntimeError, ValueError):
        return None
    residual = float(np.sqrt(np.mean((law(n / scale, limit, a, b) - tau) ** 2)))
    # b near 0: limit - a x^-b ~ (limit - a) + a b ln x, a log-linear curve whose "limit" grows without bound as b
    # shrinks; such a fit says the points show no saturation, not where they saturate.
    return {"limit": round(float(limit), 3), "a": float(a), "b": round(float(b), 3), "scale": float(scale),
            "rms_residual": round(residual, 4), "saturating": bool(b >= MIN_SATURATING_B)}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    fig, ax = subplots(figsize=(6, 4))
    for family in sorted({r["drafter"] for r in results}):
        for size in sorted({s for r in results for s in r["tau"]}, key=int):
            pts = sorted((r["train_tokens"], r["tau"][size]) for r in results if r["drafter"] == family)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{family}, {size} nodes")
            fit = fit_limit(pts)
            if fit is not None:  # the fitted law, out to 10x the largest point, and its limit
                import numpy as np

                x = np.geomspace(pts[0][0], 10 * pts[-1][0], 50)
                ax.plot(x, fit["limit"] - fit["a"] * (x / fit["scale"]) ** (-fit["b"]), linestyle="--",
                        color=line.get_color(), linewidth=0.8)
    ax.set(xscale="log", xlabel="training tokens (assistant tokens, log scale)",
           ylabel="tau (tokens per verifier call)",
           title="tau on the built-in eval split, fp32, exact")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def training_record(export: Path) -> dict[str, Any]:
    """The export's epochs and wall seconds per epoch, from its run's training.json (train.record; beside the export
    folder, or inside a shipped export's specdraft/); epochs resumed mid-way are left out of the time. Empty when
    the run wrote none."""
    for path in (export / "specdraft" / "training.json", export.parent / "training.json"):
        if path.is_file():
            epochs = json.loads(path.read_text())["epochs"]
            whole = [e for e in epochs if not e.get("resumed")]
            return {"epochs": len(epochs),
                    "wall_s_per_epoch": round(sum(e["wall_s"] for e in whole) / len(whole), 1) if whole else None}
    return {}


def run_group(run: Path) -> str:
    """A run's group: its directory name without a trailing `-s<seed>` (`e3-muon-s1` -> `e3-muon`)."""
    name = run.name
    head, _, seed = name.rpartition("-s")
    return head if head and seed.isdigit() else name


def validation_curve(run: Path) -> dict[int, list[float]]:
    """A run's validation top-1 per depth at every validation: {step: [depth 1, depth 2, ...]}, from its csv logs
    (train.py logger=csv: <run>/csv/version_*/metrics.csv)."""
    import csv

    curve: dict[int, list[float]] = {}
    for path in sorted(run.glob("csv/version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                tops = sorted((int(k[len("val/step"):-len("_top1")]), float(v)) for k, v in row.items()
                              if k.startswith("val/step") and k.endswith("_top1") and "unary" not in k and v)
                if tops:
                    curve[int(row["step"])] = [v for _, v in tops]
    return curve


def training_curves(runs: list[Path], out: Path) -> list[str]:
    """The side-by-side of validation top-1 along training per group of seeds (module docstring); returns the
    markdown lines, writes training_curve.json."""
    groups: dict[str, dict[str, dict[int, list[float]]]] = {}
    for run in runs:
        groups.setdefault(run_group(run), {})[run.name] = validation_curve(run)
    summary: dict[str, Any] = {}
    lines = ["Validation top-1 per depth along training: the seeds' mean [min, max] at each validation step.", ""]
    for group, seeds in groups.items():
        steps = sorted(set.intersection(*(set(c) for c in seeds.values()))) if seeds else []
        if not steps:
            continue
        depth = min(len(c[s]) for c in seeds.values() for s in steps)
        rows = {s: [[c[s][d] for c in seeds.values()] for d in range(depth)] for s in steps}
        summary[group] = {"seeds": sorted(seeds), "steps": steps,
                          "mean": [[sum(v) / len(v) for v in rows[s]] for s in steps],
                          "min": [[min(v) for v in rows[s]] for s in steps],
                          "max": [[max(v) for v in rows[s]] for s in steps]}
        lines += [f"**{group}** ({len(seeds)} seeds: {', '.join(sorted(seeds))})", "",
                  "| step | " + " | ".join(f"depth {d + 1}" for d in range(depth)) + " |",
                  "|---|" + "---|" * depth]
        lines += [f"| {s} | " + " | ".join(f"{sum(v) / len(v):.3f} [{min(v):.3f}, {max(v):.3f}]" for v in rows[s])
                  + " |" for s in steps]
        lines.append("")
    for a, ga in summary.items():  # the first step where a's mean depth-1 reaches b's final mean depth-1
        for b, gb in summary.items():
            if a == b:
                continue
            target = gb["mean"][-1][0]
            hit = next((s for s, m in zip(ga["steps"], ga["mean"]) if m[0] >= target), None)
            final = gb["steps"][-1]
            share = f"{hit / final:.0%} of {b}'s {final} steps" if hit is not None else "never in this run"
            summary[a].setdefault("reaches", {})[b] = hit
            lines.append(f"- {a} reaches {b}'s final depth-1 top-1 ({target:.3f}) at step {hit}: {share}")
    (out / "training_curve.json").write_text(json.dumps(summary, indent=2))
    (out / "training_curve.md").write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="*", help="exports to decode (none: only merge the --include files)")
    ap.add_argument("--tokens", type=int, nargs="*", help="training tokens of each export (default: its train_tokens)")
    ap.add_argument("--tree-sizes", type=int, nargs="*", default=[16, 24], help="tree=auto node budgets (none: "
                    "with --chain, the chain only)")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=5, help="depths of teacher-forced chain accuracy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default="~/.cache/specdraft")
    ap.add_argument("--out", default="outputs/learning_curve")
    ap.add_argument("--wandb", default=None, help="online | offline | disabled (default: the project's rule)")
    ap.add_argument("--include", nargs="*", default=[], help="learning_curve.json files of earlier runs with the same "
                    "settings: their rows join the table and the plot (a curve built export by export)")
    ap.add_argument("--runs", nargs="*", default=[], help="training run directories (logger=csv): their exports, "
                    "and their validation top-1 along training per group of seeds")
    ap.add_argument("--prompts", nargs="+", default=["builtin"], help="prompt sources: builtin (its eval split), "
                    "humaneval, a .jsonl file; --num-prompts from each")
    ap.add_argument("--chain", type=int, default=0, help="also decode with a chain of this many drafts: the "
                    "acceptance per position")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = [Path(r).expanduser() for r in args.runs]
    if runs:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        print("\n".join(training_curves(runs, Path(args.out))))
    exports = [Path(e).expanduser() for e in args.exports] + [r / "export" for r in runs]
    configs = [read_config(e) for e in exports]
    tokens = args.tokens or [c.get("train_tokens") for c in configs]
    if len(tokens) != len(exports) or any(t is None for t in tokens):
        sys.exit(f"training tokens unknown for {[str(e) for e, t in zip(exports, tokens) if t is None]}: exports "
                 f"written before `train_tokens` was recorded need --tokens, one per export")
    if not exports:
        if not args.include:
            sys.exit("nothing to do: give exports to decode, or --include files to merge")
        return report([], args)
    verifier = load_verifier(export_verifier(configs[0]), "float32", "cpu", args.cache_dir)
    convs = [c for source in args.prompts for c in select_prompts(
        load_conversations(source, split="eval" if source == "builtin" else None), args.num_prompts)]
    prompts = [torch.tensor([prompt_ids(verifier.tokenizer, c.messages)]) for c in convs]
    eos = verifier.tokenizer.eos_token_id
    t0 = time.perf_counter()
    plain = [greedy_decode(verifier, x, args.max_new_tokens, eos).tokens[0].tolist() for x in prompts]
    print(f"plain greedy: {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s")
    answers = list(build_selfdistill(verifier, convs, args.cache_dir, max_new_tokens=args.max_new_tokens,
                                     batch_size=16).with_format("python"))
    ceiling = verifier_top1(verifier, answers)
    print(f"verifier's mean top-1 probability on its own answers (T=1): {ceiling:.3f}")
    results = []
    for export, config, n_tokens in zip(exports, configs, tokens):
        label = export.parent.name if export.name == "export" else export.name
        row: dict[str, Any] = {"export": str(export), "drafter": title(export_kind(config)), "run": label,
                               "train_tokens": int(n_tokens), "tau": {}, "greedy_match": {}}
        for size in args.tree_sizes:
            drafter = make_drafter(None, verifier, AutoTree(size), checkpoint=export)
            t0 = time.perf_counter()
            outs = [speculative_decode(verifier, drafter, x, args.max_new_tokens, eos) for x in prompts]
            row["tau"][str(size)] = mean_accept_length(torch.cat([o.accept_lengths.flatten() for o in outs]))
            row["greedy_match"][str(size)] = sum(o.tokens[0].tolist() == p for o, p in zip(outs, plain)) / len(plain)
            print(f"{export}: {size} nodes, tau {row['tau'][str(size)]:.3f}, greedy match "
                  f"{row['greedy_match'][str(size)]:.0%} ({time.perf_counter() - t0:.0f} s)")
        if args.chain:
            drafter = make_drafter(None, verifier, Chain(args.chain), checkpoint=export)
            outs = [speculative_decode(verifier, drafter, x, args.max_new_tokens, eos) for x in prompts]
            lengths = torch.cat([o.accept_lengths.flatten() for o in outs])
            row["chain_tau"] = mean_accept_length(lengths)
            row["chain_alpha"] = [round(float(a), 4) for a in per_position_acceptance(lengths[:, None], args.chain)]
            row["chain_match"] = sum(o.tokens[0].tolist() == p for o, p in zip(outs, plain)) / len(plain)
            print(f"{export}: chain of {args.chain}, tau {row['chain_tau']:.3f}, alpha {row['chain_alpha']}, "
                  f"greedy match {row['chain_match']:.0%}")
        row["chain_accuracy"] = []
        if args.depth:  # teacher-forced (--depth 0: none)
            loaded = load_export(export, verifier)
            tables = score_export(loaded.kind, loaded.net, verifier, answers, args.depth, keep=loaded.train_ids)
            row["chain_accuracy"] = [float(a) for a in tables["chain_conditional"]]
        row["verifier_top1"] = ceiling
        row["train_depth1_top1"] = config.get("train_depth1_top1")  # last epoch's, on training batches
        row |= training_record(export)
        results.append(row)
    report(results, args)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Join the rows of --include files, then write the JSON, the table, the plot and the W&B run."""
    for earlier in args.include:
        have = {x["export"] for x in results}
        results += [r for r in json.loads(Path(earlier).read_text()) if r["export"] not in have]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning_curve.json").write_text(json.dumps(results, indent=2))
    chained = any("chain_alpha" in r for r in results)
    head = ["drafter", "training tokens", *(f"tau @{s}" for s in args.tree_sizes), "greedy match",
            *(["chain tau", "alpha per position"] if chained else []),
            *(f"acc d{d + 1}" for d in range(args.depth)), "train d1", "epochs", "s / epoch", "run"]
    cells = [[r["drafter"], f"{r['train_tokens']:,}",
              *(f"{r['tau'][str(s)]:.2f}" for s in args.tree_sizes),
              f"{min([*r['greedy_match'].values(), r.get('chain_match', 1.0)]):.0%}",
              *([f"{r['chain_tau']:.3f}" if "chain_tau" in r else "",
                 " / ".join(f"{a:.3f}" for a in r.get("chain_alpha", []))] if chained else []),
              *(f"{a:.2f}" for a in r["chain_accuracy"][: args.depth]),
              *[""] * (args.depth - len(r["chain_accuracy"][: args.depth])),  # Medusa: as deep as its heads
              "" if r.get("train_depth1_top1") is None else f"{r['train_depth1_top1']:.2f}",
              str(r.get("epochs", "")), "" if r.get("wall_s_per_epoch") is None else f"{r['wall_s_per_epoch']:,.0f}",
              r.get("run", "")]
             for r in sorted(results, key=lambda r: (r["drafter"], r["train_tokens"], r.get("run", "")))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(c) + " |" for c in cells)]
    ceilings = sorted({r["verifier_top1"] for r in results if r.get("verifier_top1") is not None})
    ceiling = ceilings[0] if len(ceilings) == 1 else None
    if ceiling is not None:
        lines += ["", f"The verifier's mean top-1 probability on its own answers to these prompts (T=1): {ceiling:.3f} "
                  "(a ceiling indicator: where it is low, M_q's argmax is hard to predict for any drafter)."]
    fits = []
    for family in sorted({r["drafter"] for r in results}):
        for size in args.tree_sizes:
            pts = sorted((r["train_tokens"], r["tau"][str(size)]) for r in results
                         if r["drafter"] == family and str(size) in r["tau"])
            fit = fit_limit(pts)
            if fit is not None:
                at_10x = fit["limit"] - fit["a"] * 10 ** (-fit["b"])
                where = (f"limit {fit['limit']:.2f}" if fit["saturating"] else
                         "no saturation in this range (the exponent is near 0: tau grows about log-linearly, and the "
                         f"fitted 'limit' {fit['limit']:.2f} means nothing)")
                fits.append(f"{family} @{size}: {where} (tau = limit - a (N / {fit['scale']:,.0f})^-{fit['b']:.2f}, "
                            f"rms residual {fit['rms_residual']:.3f}; at 10x the tokens {at_10x:.2f})")
    if fits:
        lines += ["", "Where the curves point (a saturating power law fitted to each curve of 4+ points; an "
                  "extrapolation, not a measurement):", "", *(f"- {f}" for f in fits)]
    (out / "learning_curve.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "learning_curve.png")
    print("\n".join(lines))
    print(f"written: {out}/learning_curve.json, .md, .png")

    import wandb

    from runtime.wandb_mode import wandb_mode

    run = wandb.init(project="specdraft", job_type="learning_curve", dir=str(out), mode=wandb_mode(args.wandb),
                     config={"tree_sizes": args.tree_sizes, "num_prompts": args.num_prompts,
                             "max_new_tokens": args.max_new_tokens})
    table = wandb.Table(columns=head, data=cells)
    run.log({"learning_curve/table": table, "learning_curve/plot": wandb.Image(str(out / "learning_curve.png")),
             **({} if ceiling is None else {"learning_curve/verifier_top1": ceiling})})
    run.finish()


if __name__ == "__main__":
    main()

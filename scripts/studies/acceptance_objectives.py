"""Acceptance objectives side by side: EAGLE-3, DFlash, DFlash + D-PACE and DSpark, each trained under `kl` and
`lk_hybrid` on the same data and budget, then decoded on the same prompts, greedy and at T = 0.7, with token and
block verification.

    python -m scripts.studies.acceptance_objectives train [--limit 1200] [--epochs 2]   # resumable: rerun it
    python -m scripts.studies.acceptance_objectives eval  [--prompts 4] [--tokens 96]
    python -m scripts.studies.acceptance_objectives table                               # objectives.md from both

`train` runs `python train.py` once per arm (the `ship_*` recipes on the shipped set's first `--limit`
conversations of one fixed shuffle, `--epochs` epochs, the same hidden-state cache), one after the other; an arm
whose export exists is skipped, one with a `last.ckpt` resumes. Build the cache first with
`python -m scripts.tools.build_data experiment=ship_eagle3 data.limit=<limit>`.

`eval` decodes every export on the same prompts (`--prompts` from each of the eval split, HumanEval and MT-bench
first turns), each a chain of `--depth` drafts (DSpark's whole chain, no confidence cut):
- `sampled` (no timing, so it may share the machine): greedy, tau, per-position acceptance and greedy_match against
  plain greedy; at T = 0.7, scripts.bench.block_verify's exact scoring: every round's drafted chain scored under both
  rules (token: rejection sampling draft by draft; block: block verification), E[tau] per round, for the drafters'
  top-1 chains and their sampled chains, paired on the same drafts (far less noise than two sampled runs' taus).
  Incremental: a rerun scores the arms not yet in sampled.json;
- `greedy` (timed: run it alone): the harness, `python -m eval method=all drafter=export tree=chain ...`, every
  export (and `--reference`, the shipped EAGLE-3) beside plain decoding and the other families on the same prompts:
  tokens/s and speedup; `--timed-temperature 0.7 --verify token|block` the same sampled (proposals sampled too),
  into t0.7-<rule>/.

Writes outputs/objectives/{training,sampled}.json and a report.json per timed run; `table` turns them into the
markdown tables of docs/results/objectives.md. Nothing is asserted: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "outputs" / "objectives"
MT_BENCH = Path.home() / ".cache" / "specdraft" / "evalsets" / "mt_bench_question.jsonl"  # README, "Prompts"

# arm -> the train.py overrides that make it (recipe, family, weighting); each arm runs under both losses. The block
# drafters train over the full vocabulary: DSpark's Markov bias is a full-vocabulary term, so DFlash's `train_vocab`
# (a 4,096-row head in the shipped recipe) is left out for all three, to compare like with like.
ARMS: dict[str, list[str]] = {
    "eagle3": ["experiment=ship_eagle3"],
    "dflash": ["experiment=ship_dflash", "model.train_vocab=null"],
    "dflash-dpace": ["experiment=ship_dflash", "model.train_vocab=null", "model.slot_weighting=dpace"],
    "dspark": ["experiment=ship_dflash", "model=dspark", "~model.train_vocab"],
}
LOSSES = ("kl", "lk_hybrid")
ORDER = [("dflash", "kl"), ("dspark", "kl"), ("eagle3", "kl"), ("eagle3", "lk_hybrid"), ("dflash-dpace", "kl"),
         ("dspark", "lk_hybrid"), ("dflash", "lk_hybrid"), ("dflash-dpace", "lk_hybrid")]  # every arm's kl first


def run_name(arm: str, loss: str) -> str:
    return f"obj-{arm}-{loss.replace('_', '')}"


def export_dir(arm: str, loss: str) -> Path:
    return ROOT / "outputs" / run_name(arm, loss) / "export"


def train(args: argparse.Namespace) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    record_path = OUT / "training.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    order = [tuple(a.split(":")) for a in args.arms] if args.arms else ORDER
    for arm, loss in order:
        if arm not in ARMS or loss not in LOSSES:
            raise SystemExit(f"--arms {arm}:{loss}: arms are {list(ARMS)}, losses {list(LOSSES)}")
        name = run_name(arm, loss)
        if export_dir(arm, loss).exists():
            print(f"[objectives] {name}: export exists, skipped")
            continue
        cmd = [sys.executable, "train.py", *ARMS[arm], f"model.loss={loss}", f"data.limit={args.limit}",
               f"trainer.max_epochs={args.epochs}", f"name={name}", "logger=csv", *args.extra]
        if (ROOT / "outputs" / name / "checkpoints" / "last.ckpt").exists():
            cmd.append("ckpt_path=last")
        print("[objectives]", " ".join(cmd[1:]), flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        seconds = time.perf_counter() - start
        config = json.loads((export_dir(arm, loss) / "config.json").read_text())
        record[name] = {"arm": arm, "loss": loss, "command": " ".join(cmd[1:]), "wall_s": round(seconds, 1),
                        **{k: config.get(k) for k in ("val_step_top1", "estimated_tau", "expected_accepted_length",
                                                      "train_tokens")}}
        record_path.write_text(json.dumps(record, indent=2))


def exports(allow_missing: bool = False) -> list[tuple[str, Path]]:
    """(run name, export folder) of every arm; all must exist unless `allow_missing` (then only those that do)."""
    found = [(run_name(a, loss), export_dir(a, loss)) for a in ARMS for loss in LOSSES]
    missing = [str(p) for _, p in found if not p.exists()]
    if missing and not allow_missing:
        raise SystemExit(f"these arms have no export yet: {missing}; run `python -m scripts.studies."
                         f"acceptance_objectives train` first")
    return [(n, p) for n, p in found if p.exists()]


def timed_dir(temperature: float, verify: str) -> Path:
    """The timed harness run's folder: greedy/ (T = 0, token rule), else t<T>-<rule>/."""
    return OUT / ("greedy" if temperature == 0 and verify == "token" else f"t{temperature:g}-{verify}")


def evaluate_greedy(args: argparse.Namespace) -> None:
    """The timed harness over every export (module docstring); `--timed-temperature` > 0 samples (the drafters'
    proposals sampled too, so block verification can add), under `--verify`."""
    found = exports(allow_missing=True)
    missing = sorted({run_name(a, loss) for a in ARMS for loss in LOSSES} - {n for n, _ in found})
    if missing:
        print(f"[objectives] not trained, left out: {missing}", flush=True)
    temperature, verify = args.timed_temperature, args.verify
    out = timed_dir(temperature, verify)
    cmd = [sys.executable, "-m", "eval", "method=all", "drafter=export", "tree=chain", f"tree.depth={args.depth}",
           f"checkpoint=[{','.join([*(str(p) for _, p in found), *args.reference])}]",
           f"prompts=[{','.join(args.sets)}]",
           f"num_prompts={args.prompts}", f"max_new_tokens={args.tokens}", f"threads={args.threads}",
           f"output_dir={out}", "wandb.mode=disabled"]
    if temperature > 0:
        cmd += [f"temperature={temperature}", "sampled_drafts=true", f"seed={args.seed}"]
    if verify != "token":
        cmd += [f"verify={verify}"]
    print("[objectives]", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def evaluate_sampled(args: argparse.Namespace) -> None:
    import torch

    from data.chat import prompt_ids
    from data.prompts import load_prompt_sets
    from eval.drafters.build import export
    from eval.engine.acceptance.protocol import mean_accept_length, per_position_acceptance
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.sampling import SamplingConfig
    from eval.engine.tree import Chain
    from eval.runner import user_turns
    from models.verifiers.embedded import load_smollm2
    from scripts.bench.block_verify import paired_rules

    torch.set_num_threads(args.threads)
    verifier = load_smollm2(dtype="bfloat16", device="cpu")
    cfg = SamplingConfig(temperature=args.temperature)

    def encode(num: int) -> list[torch.Tensor]:
        return [torch.tensor([prompt_ids(verifier.tokenizer, user_turns(c)[0])])
                for c in load_prompt_sets(list(args.sets), num)]

    prompts, scored_prompts = encode(args.prompts), encode(args.sampled_prompts)
    settings = {"temperature": args.temperature, "prompts": len(prompts), "tokens": args.tokens, "depth": args.depth,
                "sampled_prompts": len(scored_prompts), "sampled_tokens": args.sampled_tokens,
                "sets": list(args.sets), "seed": args.seed}
    path_json = OUT / "sampled.json"
    results: dict[str, Any] = json.loads(path_json.read_text()) if path_json.exists() else {}
    if {k: results.get(k) for k in settings} != settings:
        results = {**settings, "runs": {}}  # other settings: scored again
    with torch.inference_mode():
        plain = [greedy_decode(verifier, x, args.tokens).tokens for x in prompts]
    for name, path in exports(allow_missing=True):  # the arms trained so far; a rerun scores what is missing
        row = results["runs"].setdefault(name, {})
        if "greedy" not in row:
            drafter = export(verifier, Chain(args.depth), str(path))  # DSpark: the whole chain (no confidence cut)
            with torch.inference_mode():
                decoded = [speculative_decode(verifier, drafter, x, args.tokens) for x in prompts]
            accepted = torch.cat([d.accept_lengths for d in decoded])  # every round of every prompt, pooled
            row["greedy"] = {
                "rounds": accepted.numel(), "tau": mean_accept_length(accepted),
                "accept_rate_per_position": per_position_acceptance(accepted, args.depth).tolist(),
                "greedy_match": sum(torch.equal(d.tokens, t) for d, t in zip(decoded, plain)) / len(prompts)}
            print(f"[objectives] {name} greedy: tau {row['greedy']['tau']:.3f}, acceptance "
                  f"{[round(a, 3) for a in row['greedy']['accept_rate_per_position']]}, greedy_match "
                  f"{row['greedy']['greedy_match']}", flush=True)
            _save(results, path_json)
        for key, sampled in (("top1", False), ("sampled", True)):
            if key in row:
                continue
            row[key] = r = paired_rules(verifier, str(path), scored_prompts, cfg, args.sampled_tokens, args.depth,
                                        args.seed, sampled)
            print(f"[objectives] {name} {key}: {r['rounds']} rounds, E[tau] token {r['expected_tau_token']:.4f} +- "
                  f"{r['expected_tau_token_sem']:.4f}, block {r['expected_tau_block']:.4f} "
                  f"({r['block_minus_token']:+.4f} +- {r['block_minus_token_sem']:.4f})", flush=True)
            _save(results, path_json)


def _save(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(path)


def _num(row: dict[str, Any], key: str, fmt: str = ".3f") -> str:
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


def table(_: argparse.Namespace) -> None:
    """docs/results/objectives.md's tables from training.json, sampled.json and (when run) greedy/report.json."""
    training = json.loads((OUT / "training.json").read_text())
    scored = json.loads((OUT / "sampled.json").read_text())["runs"]
    print("| drafter | loss | train s | val E[accepted length] | greedy: tau | acceptance 1 / 2 / 3 / 4 | greedy_match "
          "| T=0.7, top-1 drafts: E[tau] token | block | T=0.7, sampled drafts: E[tau] token | block - token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, t in training.items():
        run = scored.get(name, {})
        g, top1, samp = run.get("greedy", {}), run.get("top1", {}), run.get("sampled", {})
        alpha = " / ".join(f"{a:.3f}" for a in g.get("accept_rate_per_position", []))
        print(f"| {t['arm']} | {t['loss']} | {t['wall_s']:.0f} | {_num(t, 'expected_accepted_length')} | "
              f"{_num(g, 'tau')} | {alpha} | {_num(g, 'greedy_match', '.2f')} | "
              f"{_num(top1, 'expected_tau_token')} +- {_num(top1, 'expected_tau_token_sem')} | "
              f"{_num(top1, 'expected_tau_block')} | {_num(samp, 'expected_tau_token')} +- "
              f"{_num(samp, 'expected_tau_token_sem')} | {_num(samp, 'block_minus_token', '+.4f')} +- "
              f"{_num(samp, 'block_minus_token_sem', '.4f')} |")
    for folder in sorted(OUT.iterdir()):
        report = folder / "report.json"
        if not report.exists():
            continue
        data = json.loads(report.read_text())
        sampling = data.get("sampling", {})
        print(f"\n{folder.name}: temperature {sampling.get('temperature')}, verify {sampling.get('verify')}, "
              f"sampled drafts {sampling.get('sampled_drafts')}, {data.get('num_prompts')} prompts, "
              f"{data.get('max_new_tokens')} tokens\n")
        print("| method | tau | acceptance 1 / 2 / 3 / 4 | draft ms / round | verify ms / round | tokens/s | speedup |")
        print("|---|---|---|---|---|---|---|")
        for m, r in data["methods"].items():
            alpha = " / ".join(f"{a:.3f}" for a in (r.get("accept_rate_per_position") or [])[:4])
            print(f"| {m} | {_num(r, 'tau')} | {alpha} | {_num(r, 'draft_ms_per_round', '.1f')} | "
                  f"{_num(r, 'verify_ms_per_round', '.1f')} | {_num(r, 'tokens_per_s', '.1f')} | "
                  f"{_num(r, 'speedup', '.2f')}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["train", "eval", "greedy", "sampled", "table"])
    ap.add_argument("--limit", type=int, default=1200)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--reference", nargs="*", default=[str(ROOT / "pretrained" / "eagle3-smollm2")],
                    help="exports decoded beside the arms in the timed run (the target: the shipped EAGLE-3's speedup)")
    ap.add_argument("--arms", nargs="*", default=None, help="train these arms, in order (arm:loss, e.g. dspark:kl)")
    ap.add_argument("--extra", nargs="*", default=[], help="more train.py overrides for these arms, recorded in "
                    "training.json (e.g. data.batch_size=8 trainer.accumulate_grad_batches=2: the same batch in "
                    "half the memory)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts from each set")
    ap.add_argument("--sets", nargs="+", default=["builtin", "humaneval", str(MT_BENCH)],
                    help="prompt sets (eval's prompts=): builtin, humaneval, a question.jsonl")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=4, help="drafts per chain, every drafter")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--sampled-prompts", type=int, default=2,
                    help="prompts from each set for the T=0.7 scoring (a verifier forward over the sequence a round)")
    ap.add_argument("--sampled-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timed-temperature", type=float, default=0.0,
                    help="the timed harness's temperature (greedy step; > 0: sampled, proposals sampled too)")
    ap.add_argument("--verify", choices=["token", "block"], default="token", help="the timed harness's rule")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    steps: dict[str, list[Callable[[argparse.Namespace], None]]] = {
        "train": [train], "eval": [evaluate_sampled, evaluate_greedy], "greedy": [evaluate_greedy],
        "sampled": [evaluate_sampled], "table": [table]}
    for step in steps[args.step]:
        step(args)


if __name__ == "__main__":
    main()

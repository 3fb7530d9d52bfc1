"""Write the long-input training prompts (data/long_tasks.py) as a prompt file for self-distillation: documents that
ship with Python and installed packages, task templates over them, every prompt and every passage checked against
the decontamination lists named.

    python -m scripts.tools.long_tasks --out ~/.cache/specdraft/prompts/long_tasks.jsonl --num 1200 \\
        --lists builtin_eval,humaneval,mt_bench,gsm8k,cnn_dailymail,wmt,natural_questions \\
        --benchmark mt_bench=~/.cache/specdraft/evalsets/mt_bench_question.jsonl

A list without a file (`--benchmark gsm8k=/path/test.jsonl`) is reported as not checked, here and in the JSON
written beside the prompt file (<out>.decontam.json), which scripts/tools/ship_data.py copies into the manifest.
Prints the count per task kind, the prompt lengths in the default verifier's tokens, and the licences.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from data.benchmarks import BENCHMARKS, guard_for
from data.chat import prompt_ids
from data.long_tasks import build_tasks, default_documents
from runtime.errors import UserError, exit_on_user_error
from runtime.io import refuse_existing, write_new_files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the .jsonl to write")
    ap.add_argument("--num", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lists", default=",".join(BENCHMARKS), help="decontamination lists, comma-separated, or none")
    ap.add_argument("--benchmark", action="append", default=[], metavar="NAME=PATH",
                    help="the test-split file of a list (repeat)")
    ap.add_argument("--max-tokens", type=int, default=1150, help="drop prompts longer than this after the template")
    ap.add_argument("--force", action="store_true", help="replace --out (and its .decontam.json) if they exist")
    args = ap.parse_args()
    exit_on_user_error(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    out = Path(args.out).expanduser()
    summary_path = Path(f"{out}.decontam.json")
    refuse_existing([out, summary_path], args.force)  # before the work
    files = {}
    for item in args.benchmark:
        name, sep, path = item.partition("=")
        if not sep:
            raise UserError(f"--benchmark {item!r}: give NAME=PATH, e.g. --benchmark gsm8k=/data/gsm8k/test.jsonl.")
        files[name] = path
    names = [] if args.lists == "none" else [n.strip() for n in args.lists.split(",") if n.strip()]
    guard, report = guard_for(names, files) if names else (None, {})
    records, dropped = build_tasks(default_documents(), int(args.num * 1.1) + 20, seed=args.seed, guard=guard)
    from models.verifiers.embedded import load_smollm2

    tok = load_smollm2(dtype="float32", device="cpu").tokenizer
    lengths = [len(prompt_ids(tok, [{"role": "user", "content": r["prompt"]}])) for r in records]
    kept = [(r, n) for r, n in zip(records, lengths) if n <= args.max_tokens]
    dropped[f"over {args.max_tokens} tokens"] = len(records) - len(kept)
    kept = kept[: args.num]
    ns = sorted(n for _, n in kept)
    summary = {"prompts": len(kept), "seed": args.seed, "dropped": dropped, "lists": report,
               "tokens": {"min": ns[0], "median": ns[len(ns) // 2], "max": ns[-1]},
               "categories": dict(Counter(r["category"] for r, _ in kept)),
               "licences": dict(Counter(lic for r, _ in kept for lic in r["licence"].split("; ")))}
    write_new_files({out: "".join(json.dumps(r) + "\n" for r, _ in kept),
                     summary_path: json.dumps(summary, indent=1) + "\n"}, args.force)
    print(json.dumps(summary, indent=1))
    print(f"wrote {len(kept)} prompts to {out}")


if __name__ == "__main__":
    main()

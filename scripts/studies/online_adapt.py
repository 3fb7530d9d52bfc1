"""Do drafters adapted to what they serve accept more on prompts no one trained on? The shipped export as it is,
learning while it decodes (drafter.adapt=online), fine-tuned exports (on-policy distillation, a served record), prompt
lookup and the hybrid, side by side on one stream.

    python -m scripts.studies.online_adapt pretrained/eagle3-smollm2 --prompts builtin --num-prompts 24 \
        --setting off --setting lr=3e-5 --also opd=outputs/opd-eagle3/export --hybrid

One stream of prompts (round-robin over the set's categories, as eval's num_prompts takes them), decoded in order by
each method, interleaved prompt by prompt so that every method meets the machine in the same state: each setting's
drafter of the export (fresh at the stream's start and learning through it; `off`: the export as it is), each
`--also` export as it is, prompt lookup and (`--hybrid`) the export's and each `--also` export's drafter with lookup's
chains grafted in, beside our plain greedy decoding on the same prompts, all in one process (ratios within one run).
The first half of the stream is where a learner adapts; the figures that count are the second half's: tau, tokens/s,
the speedup over plain, and the learner's update time per round. Every speculative output is checked equal to plain
greedy's. Writes online_adapt.json (every prompt's figures) and online_adapt.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from data.chat import prompt_ids
from data.prompts import load_prompt_sets
from eval.drafters.build import make_drafter
from eval.drafters.hybrid import hybrid
from eval.drafters.lookup import PromptLookupDrafter
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import Chain, DynamicTree
from eval.runner import user_turns
from models.exports.io import export_verifier, load_export, read_config
from models.verifiers.load import load_verifier
from runtime.errors import UserError, exit_on_user_error


def parse_setting(text: str) -> dict[str, Any]:
    """`off`, or `key=value,...` over drafter.adapt_<key> (lr, every, window, depth)."""
    if text == "off":
        return {}
    out: dict[str, Any] = {"adapt": "online"}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in ("lr", "every", "window", "depth") or not value:
            raise UserError(f"--setting {text!r}: give off, or key=value pairs over lr, every, window, depth.")
        out[f"adapt_{key}"] = float(value) if key == "lr" else int(value)
    return out


def decode_one(name: str, drafter: Any, verifier: Any, i: int, ids: Any, plain: Any, max_new: int) -> dict[str, Any]:
    """Prompt `i` decoded by `name`'s drafter, checked against plain greedy decoding, as one row."""
    learner = getattr(drafter, "learner", None)
    ms_before = learner.ms if learner is not None else 0.0
    r = speculative_decode(verifier, drafter, ids, max_new)
    if r.tokens[0].tolist() != plain.tokens[0].tolist():
        raise AssertionError(f"{name}: prompt {i}'s output differs from plain greedy decoding")
    rounds = max(len(r.accept_lengths), 1)
    print(f"[adapt] {name} prompt {i}: tau {r.tau:.3f}, {r.tokens.shape[1] / r.times['total_s']:.1f} tok/s "
          f"(plain {plain.tokens.shape[1] / plain.times['total_s']:.1f})", flush=True)
    return {"method": name, "prompt": i, "new_tokens": int(r.tokens.shape[1]), "rounds": rounds, "tau": r.tau,
            "seconds": r.times["total_s"], "plain_seconds": plain.times["total_s"],
            "update_ms_per_round": ((learner.ms if learner is not None else 0.0) - ms_before) / rounds}


def parse_also(texts: list[str]) -> dict[str, Path]:
    """`--also NAME=EXPORT`: more exports of the same verifier, decoded as they are."""
    out = {}
    for text in texts:
        name, _, path = text.partition("=")
        if not name or not path or not (Path(path) / "config.json").is_file():
            raise UserError(f"--also {text!r}: give NAME=<an export folder holding config.json>, e.g. "
                            f"--also opd=outputs/opd-eagle3/export.")
        out[name] = Path(path)
    return out


def summary(rows: list[dict[str, Any]], half: int) -> dict[str, Any]:
    out = {}
    for part, sel in (("first", rows[:half]), ("second", rows[half:])):
        tokens, rounds = sum(r["new_tokens"] for r in sel), sum(r["rounds"] for r in sel)
        secs, plain = sum(r["seconds"] for r in sel), sum(r["plain_seconds"] for r in sel)
        out[part] = {"tau": tokens / rounds, "tokens_per_s": tokens / secs, "speedup": plain / secs,
                     "update_ms_per_round": sum(r["update_ms_per_round"] * r["rounds"] for r in sel) / rounds}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export")
    ap.add_argument("--prompts", nargs="+", default=["builtin"])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", choices=["chain", "dynamic"], default="chain")
    ap.add_argument("--depth", type=int, default=3, help="the chain's drafts (tree=chain)")
    ap.add_argument("--setting", action="append", default=None, help="off, or lr=..,every=..,window=..,depth=..")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft"))
    ap.add_argument("--no-lookup", action="store_true", help="leave prompt lookup out (a sweep whose reference ran)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=EXPORT",
                    help="another export of the same verifier, decoded as it is (e.g. a fine-tuned one)")
    ap.add_argument("--hybrid", action="store_true",
                    help="also the export's drafter (and each --also export's) with prompt lookup grafted in")
    ap.add_argument("--out", default="outputs/online_adapt")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def run() -> None:
        settings = {s: parse_setting(s) for s in (args.setting or ["off", "lr=3e-4"])}
        if (Path(args.out) / "online_adapt.json").exists():
            raise UserError(f"--out {args.out} already holds online_adapt.json: give a new folder, so no earlier "
                            f"measurement is overwritten.")
        export = Path(args.export)
        verifier = load_verifier(export_verifier(read_config(export), export / "config.json"), args.dtype, "cpu",
                                 args.cache_dir)
        loaded = load_export(export, verifier)
        convs = load_prompt_sets(args.prompts if len(args.prompts) > 1 else args.prompts[0], args.num_prompts)
        prompts = [torch.tensor([prompt_ids(verifier.tokenizer, user_turns(c)[0], verifier.rendering)])
                   for c in convs]
        plain = [greedy_decode(verifier, ids, args.max_new_tokens) for ids in prompts]
        tree = Chain(args.depth) if args.tree == "chain" else DynamicTree()
        dtype = args.dtype if args.dtype != "float32" else None
        drafters: dict[str, Any] = {} if args.no_lookup else {
            "prompt_lookup": PromptLookupDrafter(Chain(10), 10, 3, 1)}
        for name, options in settings.items():
            drafters[name] = make_drafter(None, verifier, tree, checkpoint=loaded, dtype=dtype, **options)
        also = parse_also(args.also)
        for name, path in also.items():
            drafters[name] = make_drafter(None, verifier, tree, checkpoint=load_export(path, verifier), dtype=dtype)
        if args.hybrid:
            drafters["hybrid"] = hybrid(verifier, tree, export, dtype=dtype)
            for name, path in also.items():  # each adapted export with lookup's chains grafted in, as eval runs it
                drafters[f"hybrid:{name}"] = hybrid(verifier, tree, path, dtype=dtype)
        rows = [decode_one(name, drafter, verifier, i, ids, plain[i], args.max_new_tokens)
                for i, ids in enumerate(prompts) for name, drafter in drafters.items()]
        half = len(prompts) // 2
        table = {name: summary([r for r in rows if r["method"] == name], half) for name in drafters}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "online_adapt.json").write_text(json.dumps({"args": vars(args), "summary": table, "rows": rows},
                                                          indent=2))
        lines = ["| method | tau, 1st half | tau, 2nd half | tok/s, 2nd half | speedup over plain, 2nd half | "
                 "update ms / round |", "|---|---|---|---|---|---|"]
        for name, s in table.items():
            lines.append(f"| {name} | {s['first']['tau']:.3f} | {s['second']['tau']:.3f} | "
                         f"{s['second']['tokens_per_s']:.1f} | {s['second']['speedup']:.2f}x | "
                         f"{s['second']['update_ms_per_round']:.1f} |")
        (out / "online_adapt.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))

    exit_on_user_error(run)


if __name__ == "__main__":
    main()

"""The concurrency sweep of `python -m eval ... engine_peers=[vllm] engine_concurrency=[...]` (eval.serving) alone,
without our own decoder's pass over the prompts first: on a shared CPU that pass (every prompt through our plain and
speculative decoding and HF's references) can take longer than the sweep itself.

    python -m scripts.bench.serving_load pretrained/eagle3-smollm2 --concurrency 1 2 4 8 16 --tokens 1 2 3 5 \\
        --num-prompts 16 --max-new-tokens 64 --out outputs/load/eagle3

Without --out each run writes to a new outputs/load/<export>-<date-time>; an --out holding a report is refused.

The same prompts as `python -m eval` takes (`--prompts`, default the built-in eval split, round-robin over its
categories), the same sweep, schedule and prediction (the batch cost model without a draft cost: no drafter is built
here), written to <out>/report.json as `{"engine_peers": {"vllm": ...}}` with load_speedup.png and the servers' logs.

By prompt length (eval/serving/prompt_lengths.py; `engine_prompt_lengths` in `python -m eval`): `--lengths short long:8`
sweeps the short prompts (up to 511 tokens; --num-prompts of them) and 8 long ones (512+; on the built-in split its
long_context category) on the same servers, a table and a plot panel each, report.json `engine_peers.vllm.by_length`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def fresh_out(out: str | None, export: str) -> Path:
    """The sweep's folder: `out`, refused where it holds an earlier sweep's report (it would be overwritten); by
    default a new folder per run, outputs/load/<export>-<date-time>."""
    from runtime.errors import UserError

    if out is None:
        base = Path("outputs/load") / f"{Path(export).resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"
        return next(p for i in range(1, 1000) if not (p := base.with_name(f"{base.name}-{i}" if i > 1 else base.name))
                    .exists())
    path = Path(out)
    if (path / "report.json").exists():
        raise UserError(f"--out {path} holds an earlier sweep's report.json; give a new folder (or leave --out out "
                        f"for a fresh outputs/load/<export>-<date-time>), or move that report away first.")
    return path


def main(argv: list[str] | None = None) -> int:
    from data.chat import prompt_ids
    from data.prompts import load_prompt_pool, load_prompt_sets
    from eval.planner.cost import auto_dtype
    from eval.runner import user_turns
    from eval.serving.sweep import batch_predictor, check_clients, load_settings, sweep, with_export, with_groups
    from models.verifiers.load import load_verifier
    from runtime.errors import UserError
    from serve.server import read_export

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="K values (default: the export's own)")
    parser.add_argument("--prompts", default="builtin")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--lengths", nargs="+", default=None, metavar="GROUP",
                        help="the sweep once per prompt-length group: short, long; long:8 for 8 of them "
                             "(default: the prompts as one set)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-predict", action="store_true", help="skip the batch cost model")
    parser.add_argument("--out", default=None, help="the folder for report.json, the plot and the servers' logs "
                                                    "(default: a new outputs/load/<export>-<date-time>); one that "
                                                    "holds a report already is refused")
    args = parser.parse_args(argv)
    try:
        out = fresh_out(args.out, args.export)
        load = with_export(load_settings(args.concurrency, args.tokens, ["vllm"], args.export, args.lengths),
                           read_export(args.export))  # the export read once; eval's setup does the same
        assert load is not None
        dtype = auto_dtype("cpu")[0] if args.dtype == "auto" else args.dtype
        info = load.export
        torch.set_num_threads(args.threads)
        verifier = load_verifier(info.verifier, dtype, "cpu")
        pool = load_prompt_pool(args.prompts)
        load = with_groups(load, pool, args.prompts, args.num_prompts, verifier)
        assert load is not None
        if load.groups:  # the groups' prompts, the first group's first as the cost model's prefix
            prompts = [list(p) for g in load.groups for p in g.prompts]
        else:
            convs = load_prompt_sets(args.prompts, args.num_prompts, pool)
            prompts = [prompt_ids(verifier.tokenizer, user_turns(c)[0], verifier.rendering) for c in convs]
        predict = None if args.no_predict else batch_predictor(verifier.model, info.acceptance, prompts[0])
        check_clients(load, len(prompts))
        out.mkdir(parents=True, exist_ok=True)
        result = sweep(load, verifier, prompts, args.max_new_tokens, dtype, args.threads, 0.0, 0, out,
                       predict=predict)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {"engine_peers": {"vllm": result}, "checkpoint": args.export, "num_prompts": len(prompts),
              "prompt_source": args.prompts, "max_new_tokens": args.max_new_tokens, "dtype": dtype}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report: {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Why does one drafter beat another? Teacher-forced accuracy tables of exported drafters on the same held-out text.

    python -m scripts.tools.drafter_accuracy outputs/medusa-smollm2/export outputs/eagle-smollm2/export \
        outputs/eagle3-smollm2/export --num-prompts 20 --max-new-tokens 128

The verifier answers the built-in eval prompts greedily (fp32, cached like self-distillation data); every drafter is
then scored on the same answers, with the verifier's features, in one teacher-forced pass per batch:

depth-1 top-k coverage, chain accuracy per depth, and the chain's tau over positions and over simulated decode
rounds (eval/offline.py says what each means). EAGLE is unrolled by the same function training uses
(models.eagle.unroll).

Results are printed and written as JSON next to the first export (drafter_accuracy.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from data.prompts import load_conversations, select_prompts
from data.selfdistill import build_selfdistill
from eval.offline import TOPK, score_export
from models.exports.io import export_verifier, load_export, read_config
from models.verifiers.load import load_verifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="the verifier's dtype (answers and features); training uses "
                    "bfloat16, decoding float32")
    ap.add_argument("--cache-dir", default="~/.cache/specdraft")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    exports = [Path(e).expanduser() for e in args.exports]
    verifier = load_verifier(export_verifier(read_config(exports[0])), args.dtype, "cpu", args.cache_dir)
    convs = select_prompts(load_conversations("builtin", split="eval"), args.num_prompts)
    ds = build_selfdistill(verifier, convs, args.cache_dir, max_new_tokens=args.max_new_tokens, batch_size=16)
    rows = list(ds.with_format("python"))
    results = {}
    for export in exports:
        loaded = load_export(export, verifier)
        kind = loaded.kind
        res = score_export(loaded.kind, loaded.net, verifier, rows, args.depth, bf16=args.dtype == "bfloat16",
                           keep=loaded.train_ids)
        results[f"{export.parent.name} ({kind})"] = res
    table = Table(title=f"teacher-forced accuracy on {len(rows)} held-out answers ({args.max_new_tokens} tokens, "
                  f"verifier {args.dtype})")
    for col in ["drafter", *(f"d1 top-{k}" for k in TOPK), "chain d1..", "confidence d1..", "tau (positions)",
                "tau (rounds)"]:
        table.add_column(col)
    for name, r in results.items():
        table.add_row(name, *(f"{r['depth1_topk'][k]:.3f}" for k in TOPK),
                      " ".join(f"{a:.2f}" for a in r["chain_conditional"]),
                      " ".join(f"{a:.2f}" for a in r["chain_confidence"]), f"{r['tau_positions']:.3f}",
                      f"{r['tau_rounds']:.3f}")
    Console(width=200).print(table)
    out = exports[0].parent / f"drafter_accuracy-{args.dtype}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()

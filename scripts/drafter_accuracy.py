"""Why does one drafter beat another? Teacher-forced accuracy tables of exported drafters on the same held-out text.

    python scripts/drafter_accuracy.py outputs/medusa-smollm2/export outputs/eagle-smollm2/export \
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
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.datamodule import collate  # noqa: E402
from data.hidden_cache import gather_layers  # noqa: E402
from data.prompts import load_conversations, select_prompts  # noqa: E402
from data.selfdistill import build_selfdistill  # noqa: E402
from eval.offline import TOPK, acceptance_tables  # noqa: E402
from models.eagle import EagleNet, target_rank, unroll  # noqa: E402
from models.export import export_verifier, load_export, read_config  # noqa: E402
from models.medusa import medusa_targets  # noqa: E402
from models.verifier import Verifier, load_verifier  # noqa: E402


def _rank_rows(logits: Tensor, targets: Tensor, valid: Tensor, vocab: int, rank_of) -> tuple[Tensor, Tensor]:
    """(B, T) ranks of `targets` where `valid` (vocab elsewhere), and the draft's top-1 probability there."""
    rank = torch.full(valid.shape, vocab, dtype=torch.long)
    rank[valid] = rank_of(logits, targets)
    conf = torch.zeros(valid.shape)
    conf[valid] = logits.softmax(-1).amax(-1)
    return rank, conf


def medusa_ranks(heads: Any, verifier: Verifier, batch: dict[str, Tensor], depth: int) -> tuple[Tensor, ...]:
    """(D, B, T) ranks of x_{t+d+1} under head d, validity, and the head's top-1 probability."""
    hidden = gather_layers(batch, [-1], verifier, [-1])[-1]  # (B, T, D)
    vocab = verifier.vocab_size
    ranks, valids, confs = [], [], []
    for k, (targets, valid) in enumerate(medusa_targets(batch["input_ids"], batch["loss_mask"], heads.num_heads)):
        if k >= depth:
            break
        logits = heads.head_logits(hidden[valid], k, verifier.lm_head).float()  # (N, V)
        rank, conf = _rank_rows(logits, targets[valid], valid, vocab, target_rank)
        ranks.append(rank)
        valids.append(valid)
        confs.append(conf)
    return torch.stack(ranks), torch.stack(valids), torch.stack(confs)


def eagle_ranks(net: EagleNet, verifier: Verifier, batch: dict[str, Tensor], depth: int) -> tuple[Tensor, ...]:
    """The same for an EAGLE drafter, unrolled `depth` steps exactly as in training; the target of step j at
    position t is M_q's argmax at t+j+1."""
    layers = list(dict.fromkeys([*net.feature_layers, -1]))
    states = gather_layers(batch, layers, verifier, layers)
    ids, n = batch["input_ids"], batch["input_ids"].shape[1] - 1
    q_arg = verifier.lm_head(states[-1]).argmax(-1)  # (B, T): M_q's greedy token after each position
    embed, vocab = verifier.model.get_input_embeddings(), verifier.vocab_size
    ranks, valids, confs = [], [], []
    steps = unroll(net, net.features(states)[:, :n], ids, batch["attention_mask"], batch["loss_mask"].bool(), embed,
                   depth)
    for j, (out, valid) in enumerate(steps):
        bi, ti = valid.nonzero(as_tuple=True)
        logits = net.logits(out[bi, ti], verifier.lm_head).float()  # (N, V_draft)
        rank, conf = _rank_rows(logits, q_arg[bi, ti + j + 1], valid, vocab, net.target_rank)
        pad = lambda x, v: torch.cat([x, x.new_full((x.shape[0], 1), v)], dim=1)  # (B, n) -> (B, T)
        ranks.append(pad(rank, vocab))
        valids.append(pad(valid, False))
        confs.append(pad(conf, 0.0))
    return torch.stack(ranks), torch.stack(valids), torch.stack(confs)


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
        kind, drafter = loaded.kind, loaded.net
        ranks, valids, confs, masks = [], [], [], []
        for i in range(0, len(rows), 8):
            batch = collate(rows[i : i + 8], verifier.tokenizer.pad_token_id or 0)
            autocast = torch.autocast("cpu", torch.bfloat16, enabled=args.dtype == "bfloat16")  # as bf16-mixed
            with torch.no_grad(), autocast:
                r, v, c = (medusa_ranks(drafter, verifier, batch, args.depth) if kind == "medusa"
                           else eagle_ranks(drafter, verifier, batch, args.depth))
            ranks += list(r.unbind(1))
            valids += list(v.unbind(1))
            confs += list(c.unbind(1))
            masks += list(batch["loss_mask"].unbind(0))
        width = max(m.shape[0] for m in masks)
        fit = lambda xs, fill: torch.stack([torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=fill)
                                            for x in xs], dim=-2)
        res = acceptance_tables(fit(ranks, verifier.lm_head.weight.shape[0]), fit(valids, False), fit(masks, 0),
                                confidence=fit(confs, 0.0))
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

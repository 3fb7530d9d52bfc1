"""Drafter forward cost of every family with a shipped export, side by side in one process, beside the verifier's step.

    python -m scripts.bench.draft_forward [--dtype bfloat16 float32] [--threads 1] [--rounds 7] [--peagle DIR]

For each dtype of the default verifier, after a real prompt (the first conversation of the eval split) in steady
state (the drafter has cached the prefix, the last round accepted nothing, so one new position comes in), as
eval.planner.cost.draft_curve times them:
- forward: one round that drafts a single token. Medusa: one `propose` (its heads run once a round, whatever the
  tree); EAGLE-3: its layer over the new position (fc over the verifier's three layers, the decoder layer) and its head
  over the draft vocabulary, `trial(1)`; P-EAGLE and DFlash: their `trial(1)`;
- depth (EAGLE-3): one more drafted depth of a chain, (trial(5) - trial(1)) / 4 of a Chain(5) drafter: the layer over
  one drafted row and its head, what each depth of a tree costs beside the frontier's width;
- round: `trial(s)` for s drafts, each drafter built as tree.size=auto's probe builds it (AutoTree(size=max)), the
  round a plan of s drafts pays for (Medusa: the same propose);
- the verifier's one-token step through the engine, for scale.
Every callable is interleaved with the others in each round (a burst of load lands on all alike); each figure is the
median over rounds of the least of 3 calls. Ratios are to Medusa's forward. Nothing is asserted. The machine may be
shared: read the ratios, and rerun on a quiet machine for absolute ms.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from data.prompts import load_conversations
from data.selfdistill import prompt_ids
from eval.drafters.build import export
from eval.engine.session import VerifierSession
from eval.engine.timing import interleaved
from eval.engine.tree import AutoTree, Chain
from models.verifiers.embedded import load_smollm2

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {"medusa": "medusa-smollm2", "eagle3": "eagle3-smollm2", "peagle": None, "dflash": "dflash-smollm2"}
SIZES = (2, 4, 8, 16)  # tree nodes (drafts + 1) of the round curve


def _steady(verifier, drafter, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter in steady state after `prefix` (as its draft_cost sets it up): (the sequence with the root, the
    verifier's features of the one new position)."""
    layers = drafter.feature_layers
    cache = VerifierSession(verifier, "auto", prefix.shape[1] + 1, 1, 1)
    drafter.propose(prefix, cache.forward(prefix[:, :-1], layers=layers).hidden)  # the prefill
    drafter.accepted(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    new = cache.forward(prefix[:, -1:], layers=layers).hidden  # (1, 1, D)
    return torch.cat([prefix, prefix[:, -1:]], dim=1), new


def _verifier_step(verifier, prefix: torch.Tensor) -> Callable[[], None]:
    """One one-token verifier step after the prefix, rolled back after (eval.planner.cost.forward_curve's)."""
    cache = VerifierSession(verifier, "auto", prefix.shape[1] + 1, 1, 1)
    cache.forward(prefix)
    empty = torch.zeros(1, 0, dtype=torch.long)

    def run() -> None:
        cache.forward(prefix[:, -1:])
        cache.commit(prefix.shape[1], empty)

    return run


def _drafter(verifier, tree, folder: Path, family: str):
    """The export's drafter under `tree`; for '<family>-bf16' with its weights in bf16 (eval's drafter_dtype)."""
    return export(verifier, tree, folder, dtype="bfloat16" if family.endswith("-bf16") else None)


def _callables(verifier, prefix: torch.Tensor, folders: dict[str, Path]) -> dict[str, Callable[[], object]]:
    """name -> a timed call: '<family> forward', 'eagle3 chain <k>', '<family> round <s>', 'verifier step'. Family
    '<family>-bf16' is the export with its weights in bf16 (`python -m eval drafter_dtype=bfloat16`: other drafts
    than the export's fp32 weights give)."""
    fns: dict[str, Callable[[], object]] = {"verifier step": _verifier_step(verifier, prefix)}
    for family, folder in folders.items():

        if family.startswith("medusa"):
            drafter = _drafter(verifier, AutoTree(size=max(SIZES) - 1), folder, family)
            cache = VerifierSession(verifier, "auto", prefix.shape[1] + 1, 1, 1)
            hidden = cache.forward(prefix, layers=drafter.feature_layers).hidden
            seq = torch.cat([prefix, prefix[:, -1:]], dim=1)
            fns[f"{family} forward"] = lambda d=drafter, s=seq, h=hidden: d.propose(s, h)
            continue
        one = _drafter(verifier, Chain(5) if family.startswith("eagle3") else AutoTree(size=1), folder, family)
        seq, new = _steady(verifier, one, prefix)
        fns[f"{family} forward"] = lambda d=one, s=seq, n=new: d.trial(s, n, 1)
        if family.startswith("eagle3"):
            fns[f"{family} chain 5"] = lambda d=one, s=seq, n=new: d.trial(s, n, 5)
        tree = _drafter(verifier, AutoTree(size=max(SIZES) - 1), folder, family)
        seq, new = _steady(verifier, tree, prefix)
        for size in SIZES:
            fns[f"{family} round {size}"] = lambda d=tree, s=seq, n=new, k=size - 1: d.trial(s, n, k)
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--peagle", default=None, help="a P-EAGLE export for the default verifier (none ships)")
    ap.add_argument("--bf16-drafter", action="store_true", help="also every export with its weights in bf16 "
                    "(drafter_dtype=bfloat16: other drafts than the export's fp32 weights give)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folders = {f: ROOT / "pretrained" / name for f, name in SHIPPED.items() if name}
    if args.peagle:
        folders["peagle"] = Path(args.peagle)
    folders = {f: p for f, p in folders.items() if (p / "config.json").is_file()}
    if args.bf16_drafter:
        folders |= {f"{f}-bf16": p for f, p in folders.items()}
    missing = [f for f in SHIPPED if f not in folders]
    for dtype in args.dtype:
        verifier = load_smollm2(dtype=dtype, device="cpu")
        conv = load_conversations("builtin", split="eval", limit=1)[0]
        prefix = torch.tensor([prompt_ids(verifier.tokenizer, conv.messages)])
        fns = _callables(verifier, prefix, folders)
        names = list(fns)
        runs = [interleaved([fns[n] for n in names], 3) for _ in range(args.rounds)]
        ms = {n: statistics.median(r[i] for r in runs) for i, n in enumerate(names)}
        base = ms.get("medusa forward")
        ratio = (lambda x: f"{x / base:5.2f}x") if base else (lambda x: "  -  ")
        print(f"\n{dtype} verifier, {args.threads} thread(s), prefix {prefix.shape[1]} tokens, median of "
              f"{args.rounds} interleaved rounds (least of 3 each); no export for: {', '.join(missing) or 'none'}")
        print(f"  verifier one-token step {ms['verifier step']:7.2f} ms")
        head = "".join(f" {'round ' + str(s):>9}" for s in SIZES)
        print(f"  {'family':<12} {'forward ms':>10} {'/medusa':>8} {'/same dt':>8}{head}")

        def same(x: float, family: str) -> str:  # against Medusa's forward with drafter weights of the same dtype
            m = ms.get("medusa-bf16 forward" if family.endswith("-bf16") else "medusa forward")
            return f"{x / m:5.2f}x" if m else "  -  "

        for family in folders:
            rounds = "".join(f" {ms.get(f'{family} round {s}', ms[f'{family} forward']):9.2f}" for s in SIZES)
            fwd = ms[f"{family} forward"]
            print(f"  {family:<12} {fwd:10.2f} {ratio(fwd):>8} {same(fwd, family):>8}{rounds}")
        for family in ("eagle3", "eagle3-bf16"):
            if f"{family} chain 5" in ms:
                depth = (ms[f"{family} chain 5"] - ms[f"{family} forward"]) / 4
                print(f"  {family} one more drafted depth (Chain(5): (trial 5 - trial 1) / 4) {depth:6.2f} ms, "
                      f"{ratio(depth).strip()} Medusa's forward, {same(depth, family).strip()} with the same dtype")


if __name__ == "__main__":
    main()

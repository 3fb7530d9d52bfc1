"""Where a round's time goes in our decoder, part by part, against the machine's floors (a roofline table).

    python -m scripts.bench.roofline [--dtype bfloat16] [--threads 2] [--contexts 64 1500] \
        [--sizes 1 2 4 8 17 32 64] [--exports pretrained/eagle3-smollm2 pretrained/medusa-smollm2 ...] \
        [--json OUT.json]

On the embedded verifier (SmolLM2-135M), through `eval.engine.forward` as the decode loops run it:

1. **Forwards**: a plain one-token step and a verify over trees of each size (`auto_tree` of a Medusa-like table,
   size 1 = the plain step), after a prefix of each context length; wall ms (least of `--rounds` interleaved rounds,
   no profiler) and each size as a ratio to the plain step at the same context.
2. **Parts** of the plain step and of the 17-node verify: `--profiled` forwards under torch.profiler, every op
   (aten, and oneDNN's prepacked linear) charged to the innermost part it ran in, per forward. The parts are the
   engine's own functions, labelled here only (the engine is not touched): the embedding, the RMS norms, the q/k/v,
   o, gate/up and down matmuls and the vocabulary head (`Linear` calls, by weight), rotary, the tree bookkeeping
   (`_window_slots`), attention (`_attend`: scores, softmax, values over the fp32 cache), the MLP's elementwise work,
   and the forward's own body (padding, masks, KV writes). For each: the ms its ops took, the ms of Python between
   them inside that part ("gap"), the number of ops Python dispatched, and its floor: the larger of the bytes it must
   read over the measured read bandwidth and its FLOPs over the measured matmul peak (`eval.planner.cost.machine`).
   Profiled times carry the profiler's own cost (microseconds per op); the wall time without it is printed beside.
3. **Drafting**: each export's draft per round (`draft_cost`, the planner's probe: one round's drafting after a real
   prefix) at a chain of its own K and at 16 drafts, as a share of the plain step.

Nothing is asserted; read the ratios, and run it alone on the machine. docs/results/roofline.md has a run.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from eval.engine import forward as engine
from eval.engine.tree import auto_tree, tree_buffers
from eval.planner.cost import SHAPE_TABLE, machine
from models import packed
from models.verifiers.embedded import load_smollm2
from scripts.bench.long import least_ms

SIZES = (1, 2, 4, 8, 17, 32, 64)
CONTEXTS = (64, 1500)
PROFILED = (1, 17)
EXPORTS = ("pretrained/eagle3-smollm2", "pretrained/medusa-smollm2", "pretrained/dflash-smollm2")
LABELS = {"_embed": "embedding", "_rms_norm": "norms", "_rotate": "rotary", "_window_slots": "tree bookkeeping",
          "_attend": "attention", "_residual": "MLP elementwise, residual", "_qkv": "q/k/v split, q/k norms"}


class Labelled:
    """Inside it, the engine's parts run under torch.profiler labels (module functions and `Linear` calls wrapped
    here, restored on exit); `names` maps a weight's (in, out) shape to its name."""

    def __init__(self, names: dict[tuple[int, int], str]) -> None:
        self.names = names
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> Labelled:
        for fn, label in LABELS.items():
            real = getattr(engine, fn)
            self.saved[fn] = real

            def wrapped(*a, _real=real, _label=label, **k):
                with record_function(_label):
                    return _real(*a, **k)

            setattr(engine, fn, wrapped)
        kernel, names = packed.Linear._kernel, self.names
        self.saved["_kernel"] = kernel

        def labelled_kernel(lin, rows, _real=kernel):
            with record_function(f"matmul {names.get((lin.in_features, lin.out_features), '?')}"):
                return _real(lin, rows)

        packed.Linear._kernel = labelled_kernel  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        packed.Linear._kernel = self.saved.pop("_kernel")  # type: ignore[method-assign]
        for fn, real in self.saved.items():
            setattr(engine, fn, real)
        self.saved = {}


def parts(run: Callable[[], object], names: dict[tuple[int, int], str],
          reps: int = 5) -> tuple[dict[str, dict[str, float]], float]:
    """`reps` profiled calls of `run`: per part and per call, its ops' ms, the Python gap inside it and its op count;
    and the profiled wall ms per call. Each op is charged to its innermost label (the forward's body where none)."""
    run()  # warm, unprofiled
    with Labelled(names), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            with record_function("forward body"):
                run()
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"ops_ms": 0.0, "gap_ms": 0.0, "calls": 0})
    labels = set(LABELS.values()) | {"forward body"} | {f"matmul {n}" for n in names.values()} | {"matmul ?"}
    wall = 0.0
    for ev in prof.events():
        if ev.name in labels:
            table[ev.name]["gap_ms"] += ev.self_cpu_time_total / 1e3
            if ev.name == "forward body":
                wall += ev.cpu_time_total / 1e3
            continue
        if "::" not in ev.name:  # aten::, mkldnn:: (the prepacked linear) ops; not the profiler's own events
            continue
        parent = ev.cpu_parent
        while parent is not None and parent.name not in labels:
            parent = parent.cpu_parent
        if parent is None:
            continue
        table[parent.name]["ops_ms"] += ev.self_cpu_time_total / 1e3
        if ev.cpu_parent is parent or "::" not in ev.cpu_parent.name:
            table[parent.name]["calls"] += 1  # top-level ops only (what Python dispatches)
    per_call = {part: {k: value / reps for k, value in row.items()} for part, row in table.items()}
    return per_call, wall / reps


def floors(v: Any, tokens: int, context: int, mach: dict[str, Any], dtype: str) -> dict[str, float]:
    """Each part's floor in ms for one forward over `tokens` after `context` cached ones: max(bytes / bandwidth,
    FLOPs / peak); the parts without a floor worth stating (elementwise work on activations) are left out."""
    cfg = v.model.config
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = getattr(cfg, "head_dim", None) or d // hq
    width = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    bw, peak = mach["read_gbs"] * 1e6, mach["peak_gflops"][dtype] * 1e6  # bytes/ms, FLOP/ms
    shapes = {"q/k/v": (d, (hq + 2 * hkv) * dh), "o": (hq * dh, d), "gate/up": (d, 2 * cfg.intermediate_size),
              "down": (cfg.intermediate_size, d)}
    out = {f"matmul {n}": layers * max(i * o * width / bw, 2 * tokens * i * o / peak) for n, (i, o) in shapes.items()}
    out["matmul head"] = max(d * cfg.vocab_size * width / bw, 2 * tokens * d * cfg.vocab_size / peak)
    kv_bytes = layers * 2 * hkv * dh * 4 * (context + tokens)  # the fp32 cache, read once
    att_flops = layers * 4 * tokens * (context + tokens) * hq * dh
    out["attention"] = max(kv_bytes / bw, att_flops / (mach["peak_gflops"]["float32"] * 1e6))
    out["embedding"] = tokens * d * width / bw
    return out


def weight_names(v: Any) -> dict[tuple[int, int], str]:
    cfg = v.model.config
    d, hq, hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    dh = getattr(cfg, "head_dim", None) or d // hq
    return {(d, (hq + 2 * hkv) * dh): "q/k/v", (hq * dh, d): "o", (d, 2 * cfg.intermediate_size): "gate/up",
            (cfg.intermediate_size, d): "down", (d, cfg.vocab_size): "head"}


def forwards(v: Any, e: engine.Engine, contexts: list[int], sizes: list[int], rounds: int) -> dict[str, Any]:
    """Wall ms of the plain step and each tree verify after each context, least of `rounds` interleaved rounds, and
    the callables, for the profile."""
    gen = torch.Generator().manual_seed(0)
    nodes = torch.randint(0, v.vocab_size, (1, max(sizes)), generator=gen)
    fns: dict[str, Callable[[], object]] = {}
    for n in contexts:
        ids = torch.randint(0, v.vocab_size, (1, n), generator=gen)
        cache = engine.new_cache(e, n + max(sizes) + 64)
        engine.forward(cache, ids)
        for size in sizes:
            if size == 1:
                def step(c=cache, n=n):
                    engine.forward(c, nodes[:, :1])
                    c.length = n
                fns[f"{n}/1"] = step
            else:
                buf = tree_buffers(auto_tree(SHAPE_TABLE, size - 1))
                def verify(c=cache, b=buf, s=size):
                    engine.forward(c, nodes[:, :s], b.positions, b.mask)
                fns[f"{n}/{size}"] = verify
    with torch.inference_mode():
        ms = least_ms(fns, rounds)
    return {"ms": ms, "fns": fns}


def drafting(v: Any, exports: list[str], context: int, reps: int) -> dict[str, dict[str, float]]:
    """Each export's draft per round (its `draft_cost`) at a chain of its own K and at 16 drafts."""
    from eval.drafters.build import export
    from eval.engine.tree import Chain
    from models.exports.io import read_info

    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, v.vocab_size, (1, context), generator=gen)
    out = {}
    for path in exports:
        info = read_info(path)
        k = int(info.speculative_tokens or 3)
        drafter: Any = export(v, Chain(), path)  # a CostProbe (eval.engine.protocol) for every exported family
        with torch.inference_mode():
            chain, wide = drafter.draft_cost(v, prefix, [k + 1, 17], "auto", reps)
        out[Path(path).name] = {"kind": info.kind, "k": k, "chain_ms": chain, "drafts16_ms": wide}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    ap.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    ap.add_argument("--exports", nargs="*", default=list(EXPORTS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profiled", type=int, default=5, help="profiled forwards per shape (the parts are per forward)")
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = sorted(set(args.sizes) | {1})
    mach = machine(dtypes=tuple(sorted({args.dtype, "float32"})))
    v = load_smollm2(dtype=args.dtype, device="cpu")
    e = engine.Engine(v.model)
    names = weight_names(v)
    print(f"machine: {torch.get_num_threads()} thread(s), read {mach['read_gbs']:.1f} GB/s, matmul peak "
          + ", ".join(f"{k} {g:.0f} GFLOP/s" for k, g in mach["peak_gflops"].items()), flush=True)
    result: dict[str, Any] = {"machine": mach, "dtype": args.dtype, "forwards": {}, "parts": {}, "drafting": {}}
    f = forwards(v, e, args.contexts, sizes, args.rounds)
    print(f"\nforwards (least of {args.rounds} interleaved rounds, ms; x: over the plain step at that context)")
    print(f"{'context':>8} " + " ".join(f"{'n=' + str(s):>13}" for s in sizes))
    for n in args.contexts:
        plain = f["ms"][f"{n}/1"]
        print(f"{n:>8} " + " ".join(f"{f['ms'][f'{n}/{s}']:6.1f} {f['ms'][f'{n}/{s}'] / plain:5.2f}x" for s in sizes))
        result["forwards"][str(n)] = {str(s): f["ms"][f"{n}/{s}"] for s in sizes}
    for n in args.contexts:
        for size in [s for s in PROFILED if s in sizes]:
            with torch.inference_mode():
                table, wall = parts(f["fns"][f"{n}/{size}"], names, args.profiled)
            floor = floors(v, size, n, mach, args.dtype)
            name = "plain step" if size == 1 else f"{size}-node verify"
            print(f"\n{name} at context {n}: {f['ms'][f'{n}/{size}']:.1f} ms unprofiled, {wall:.1f} ms profiled")
            print(f"{'part':<28} {'ops ms':>7} {'gap ms':>7} {'calls':>6} {'floor ms':>9} {'x floor':>8}")
            total_floor = 0.0
            for part, row in sorted(table.items(), key=lambda kv: -(kv[1]["ops_ms"] + kv[1]["gap_ms"])):
                fl = floor.get(part)
                total_floor += fl or 0.0
                spent = row["ops_ms"] + row["gap_ms"]
                print(f"{part:<28} {row['ops_ms']:7.2f} {row['gap_ms']:7.2f} {int(row['calls']):6d} "
                      + (f"{fl:9.2f} {spent / fl:7.1f}x" if fl else f"{'-':>9} {'-':>8}"))
            ops = sum(r["ops_ms"] for r in table.values())
            gaps = sum(r["gap_ms"] for r in table.values())
            calls = int(sum(r["calls"] for r in table.values()))
            print(f"{'all':<28} {ops:7.2f} {gaps:7.2f} {calls:6d} {total_floor:9.2f} {wall / total_floor:7.1f}x")
            result["parts"][f"{n}/{size}"] = {"unprofiled_ms": f["ms"][f"{n}/{size}"], "profiled_ms": wall,
                                              "floor_ms": total_floor, "parts": table, "floors": floor}
    if args.exports:
        result["drafting"] = drafting(v, args.exports, args.contexts[0], max(3, args.rounds // 2))
        plain = f["ms"][f"{args.contexts[0]}/1"]
        print(f"\ndrafting per round at context {args.contexts[0]} (share of the plain step, {plain:.1f} ms)")
        for name, row in result["drafting"].items():
            print(f"{name:<24} {row['kind']:<8} chain K={row['k']}: {row['chain_ms']:6.2f} ms "
                  f"({row['chain_ms'] / plain:5.1%})   16 drafts: {row['drafts16_ms']:6.2f} ms "
                  f"({row['drafts16_ms'] / plain:5.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=float))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

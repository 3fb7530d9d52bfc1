"""Verify cost, Hugging Face (eval.engine.hf_forward) against eval.engine.forward, side by side in one process, with the
machine's bound.

    python -m scripts.bench.verify [--dtype float32 bfloat16] [--threads 1 2] [--rounds 7] [--compile]

For each dtype and thread count: a plain one-token step and a 17-node tree verify after a 128-token prefix, through
both paths, interleaved in rounds, the engine reading its whole cache (trim=False) beside it, where its weight calls
are split (AMX bf16: at 32 rows) the engine with every call padded past the split instead (the layout before), and in
bf16 the engine without prepacked weights (F.linear) (the
machine is shared: the ratio of medians is the figure to read, the spread says how noisy it was); HF `generate` greedy
per token beside our engine's greedy loop. Then the bound: weight bytes over measured read bandwidth, and bf16 / fp32
matmul peaks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eval.engine import forward as engine
from eval.engine import hf_forward as kv
from eval.engine.tree import auto_tree, tree_buffers
from models.verifiers.embedded import load_smollm2

PREFIX, NODES = 128, 17


def timed(fn, reps: int) -> float:
    fn()  # warm
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3  # ms


def machine_bound(weight_bytes: int) -> str:
    big = torch.ones(256 * 2**20)  # 1 GiB fp32
    read_sum = big.sum  # bound here: `big` is deleted below, so the generator must not look it up by name
    read = min(timed(read_sum, 3) for _ in range(3)) / 1e3
    gbs = big.numel() * 4 / read / 1e9
    peaks = {}
    for dt in (torch.bfloat16, torch.float32):
        a, b = torch.randn(1024, 2048).to(dt), torch.randn(2048, 2048).to(dt)
        sec = min(timed(lambda: a @ b, 5) for _ in range(3)) / 1e3
        peaks[dt] = 2 * 1024 * 2048 * 2048 / sec / 1e9
    del big
    return (
        f"read bandwidth {gbs:.1f} GB/s ({torch.get_num_threads()} thread(s)); matmul peak bf16 "
        f"{peaks[torch.bfloat16]:.0f} GFLOP/s, fp32 {peaks[torch.float32]:.0f} GFLOP/s; weights "
        f"{weight_bytes / 1e6:.0f} MB -> bound {weight_bytes / gbs / 1e6:.1f} ms a step"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cache-length", type=int, default=PREFIX + 64 + NODES,
                    help="the engine's preallocated cache (prompt + max_new_tokens + tree in a decode run); forwards "
                         "read its far keys only up to the last 64-key block they reach, the whole-cache rows "
                         "all of it")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", action="store_true",
                    help="also time torch.compile(engine.forward) over F.linear (inductor cannot lower the prepacked "
                         "op); TORCHINDUCTOR_FREEZING=1 for its freezing pass")
    args = ap.parse_args()
    tree = auto_tree([[0.6, 0.75, 0.8, 0.85]] * 4, NODES - 1)  # a Medusa-like 17-node tree
    buf = tree_buffers(tree)
    for name in args.dtype:
        v = load_smollm2(dtype=name, device="cpu")
        model = v.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding once
        gen = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, v.vocab_size, (1, PREFIX), generator=gen)
        nodes = torch.randint(0, v.vocab_size, (1, NODES), generator=gen)
        one = nodes[:, :1]
        for threads in args.threads:
            torch.set_num_threads(threads)
            hf = kv.new_cache()
            kv.forward(model, hf, prefix)
            packed, unpacked = engine.Engine(model), engine.Engine(model, pack=False)  # prepacked (bf16 CPU) or not
            ours = engine.new_cache(packed, args.cache_length)
            engine.forward(ours, prefix)
            plain = engine.new_cache(unpacked, args.cache_length)
            engine.forward(plain, prefix)
            whole = engine.new_cache(packed, args.cache_length, trim=False)  # every forward reads the whole cache
            engine.forward(whole, prefix)
            split = any(hi is not None for _, hi in packed.weight_rows.values())
            if split:  # the layout before splitting: every call padded past the split size (AMX: 33 rows)
                padded_engine = engine.Engine(model)
                for weight, (_, hi) in packed.weight_rows.items():
                    if hi is not None:
                        padded_engine.keep_rows(weight, (hi + 1, None))
                padded = engine.new_cache(padded_engine, args.cache_length)
                engine.forward(padded, prefix)

            def hf_step():
                kv.forward(model, hf, one)
                kv.commit(hf, PREFIX, torch.zeros(1, 0, dtype=torch.long))

            def hf_tree():
                kv.forward(model, hf, nodes, buf.positions, buf.mask)
                kv.commit(hf, PREFIX, torch.zeros(1, 0, dtype=torch.long))

            def our_step():
                engine.forward(ours, one)
                ours.length = PREFIX

            def our_tree():
                engine.forward(ours, nodes, buf.positions, buf.mask)

            def plain_step():
                engine.forward(plain, one)
                plain.length = PREFIX

            def whole_step():
                engine.forward(whole, one)
                whole.length = PREFIX

            cases = {"hf step": hf_step, "hf tree": hf_tree, "engine step": our_step, "engine tree": our_tree}
            if ours.trim_keys:  # far keys up to the last block a forward reaches, against the whole cache
                cases |= {"whole-cache step": whole_step,
                          "whole-cache tree": lambda: engine.forward(whole, nodes, buf.positions, buf.mask)}
            if split:
                def padded_step():
                    engine.forward(padded, one)
                    padded.length = PREFIX

                cases |= {"padded step": padded_step,
                          "padded tree": lambda: engine.forward(padded, nodes, buf.positions, buf.mask)}
            if packed.pack:  # the engine's weights through F.linear, as before prepacking
                cases |= {"unpacked step": plain_step,
                          "unpacked tree": lambda: engine.forward(plain, nodes, buf.positions, buf.mask)}
            if args.compile:
                # Inductor cannot lower the prepacked oneDNN op (measured: LoweringException on
                # mkldnn._linear_pointwise after a ~15 min compile), so compile the engine over F.linear, whose
                # matmuls inductor handles itself; one static graph per shape (1 token, the tree).
                comp_cache = engine.new_cache(unpacked, PREFIX + 64 + NODES)
                engine.forward(comp_cache, prefix)
                compiled = torch.compile(engine.forward, dynamic=False)
                t0 = time.perf_counter()
                compiled(comp_cache, nodes, buf.positions, buf.mask)
                compiled(comp_cache, one)
                comp_cache.length = PREFIX
                print(f"  torch.compile warm-up {time.perf_counter() - t0:.1f} s", flush=True)
                same = torch.equal(compiled(comp_cache, one).logits, engine.forward(plain, one).logits)
                comp_cache.length = plain.length = PREFIX
                print(f"  compiled step logits bitwise equal to the eager engine's: {same}", flush=True)

                def comp_step():
                    compiled(comp_cache, one)
                    comp_cache.length = PREFIX

                cases |= {
                    "compiled step": comp_step,
                    "compiled tree": lambda: compiled(comp_cache, nodes, buf.positions, buf.mask),
                }
            times: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(args.rounds):
                for k, fn in cases.items():
                    times[k].append(timed(fn, args.reps))
            med = {k: statistics.median(x) for k, x in times.items()}
            print(f"== {name}, {threads} thread(s), prefix {PREFIX}, tree {NODES} nodes, {args.rounds} rounds x "
                  f"{args.reps}: median ms [min-max]")
            for k, x in times.items():
                print(f"  {k:14s} {med[k]:7.1f} [{min(x):.1f}-{max(x):.1f}]")
            print(f"  tree/step: hf {med['hf tree'] / med['hf step']:.2f}x, engine "
                  f"{med['engine tree'] / med['engine step']:.2f}x; engine/hf: step "
                  f"{med['engine step'] / med['hf step']:.2f}x, tree {med['engine tree'] / med['hf tree']:.2f}x")
            if split:
                print(f"  weight calls split at {packed.weight_rows['qkv'][1]} rows, against padded past it: step "
                      f"{med['padded step'] / med['engine step']:.2f}x, tree "
                      f"{med['padded tree'] / med['engine tree']:.2f}x faster (padded tree/step "
                      f"{med['padded tree'] / med['padded step']:.2f}x)")
            if packed.pack:
                print(f"  prepacked weights: step {med['unpacked step'] / med['engine step']:.2f}x, tree "
                      f"{med['unpacked tree'] / med['engine tree']:.2f}x faster than F.linear (unpacked tree/step "
                      f"{med['unpacked tree'] / med['unpacked step']:.2f}x)")
            # HF generate (greedy) against our greedy loop, per token, same prompt.
            new = 32
            attention_mask = torch.ones_like(prefix)
            gen_ms, loop_ms = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                model.generate(prefix, attention_mask=attention_mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=v.tokenizer.eos_token_id)
                gen_ms.append((time.perf_counter() - t0) / new * 1e3)
                t0 = time.perf_counter()
                cache = engine.new_cache(packed, PREFIX + new)
                tok = engine.forward(cache, prefix).logits[:, -1:].argmax(-1)
                for _ in range(new - 1):
                    tok = engine.forward(cache, tok).logits[:, -1:].argmax(-1)
                loop_ms.append((time.perf_counter() - t0) / new * 1e3)
            print(f"  greedy {new} tokens incl. prefill, ms/token: HF generate {statistics.median(gen_ms):.1f}, "
                  f"engine loop {statistics.median(loop_ms):.1f}")
            print("  " + machine_bound(weight_bytes))


if __name__ == "__main__":
    main()

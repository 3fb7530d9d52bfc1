"""Long prompts, side by side in one process: the prefill against Hugging Face's forward, and verification against the
context length.

    python -m scripts.bench.long [--dtype bfloat16] [--threads 2] [--lengths 64 128 256 512 768 1024 1536 2048]

1. Prefill: for each prompt length, `eval.engine.forward.forward` on a fresh cache (what the decode loops run: the last
   position's logits) against one HF forward with SDPA over the same tokens (`logits_to_keep=1`, as HF `generate`
   prefills, and with every position's logits), interleaved in rounds, the least time of each kept. Printed as
   tokens/s, the ratio HF / ours (above 1: ours is faster), and ours as a share of the machine's matmul peak in the
   dtype (2 x matmul parameters x tokens FLOPs, the vocabulary head counted once, attention left out); then ours with
   the prefill's attention in the model's dtype (`Engine.prefill_attention = "model"`) and HF against it, and which
   of the two the default (`"auto"`, `eval.engine.forward.prefill_attention_for`) picks on this machine.
2. Context: a one-token step and a 17-node tree verify after prefixes of each length, through the engine, each as a
   ratio to the same at the shortest prefix (the target: within 1.2x at 1,500 tokens).
"""

from __future__ import annotations

import argparse
import time

import torch

from eval.engine import forward as engine
from eval.engine.tree import auto_tree, tree_buffers
from eval.planner.cost import SHAPE_TABLE, machine
from models.verifiers.embedded import load_smollm2

LENGTHS = (64, 128, 256, 512, 768, 1024, 1536, 2048)
CONTEXTS = (64, 512, 1024, 1500)
NODES = 17


def least_ms(fns: dict[str, object], rounds: int) -> dict[str, float]:
    """The least ms of each fn over `rounds` interleaved rounds (each warmed once first)."""
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[k] = min(best[k], (time.perf_counter() - start) * 1e3)
    return best


def matmul_params(model: torch.nn.Module) -> int:
    """Weights a token's forward multiplies by: every 2-D weight but the input embedding (a tied head once)."""
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    return sum(p.numel() for p in params if p.ndim == 2) - (0 if tied else embed.numel())


def prefill_table(v, lengths: list[int], rounds: int, peak: float) -> None:
    """Ours with the prefill's attention in fp32 (the engine's default) and in the model's dtype
    (`Engine.prefill_attention = "model"`), each against HF's faster forward."""
    model, e = v.model, engine.Engine(v.model)
    params = matmul_params(model)

    def ours(n: int, ids: torch.Tensor, attention: str):
        def run():
            e.prefill_attention = attention
            engine.forward(engine.new_cache(e, n + 64), ids, last_logits=True)
        return run

    print(f"prefill: {'tokens':>6} {'ours tok/s':>10} {'HF last':>9} {'HF all':>8} {'HF/ours':>8} {'of peak':>8} "
          f"{'ours, attention in ' + str(v.model.dtype).split('.')[-1]:>28} {'HF/it':>6}")
    for n in lengths:
        ids = torch.randint(0, v.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            ms = least_ms({
                "ours": ours(n, ids, "fp32"),
                "ours_model": ours(n, ids, "model"),
                "hf_last": lambda: model(ids, logits_to_keep=1),
                "hf_all": lambda: model(ids),
            }, rounds)
        hf = min(ms["hf_last"], ms["hf_all"])
        share = 2 * params * n / (ms["ours"] / 1e3) / 1e9 / peak
        print(f"         {n:6d} {n / ms['ours'] * 1e3:10.0f} {n / ms['hf_last'] * 1e3:9.0f} "
              f"{n / ms['hf_all'] * 1e3:8.0f} {hf / ms['ours']:7.2f}x {share:7.0%} "
              f"{n / ms['ours_model'] * 1e3:28.0f} {hf / ms['ours_model']:5.2f}x", flush=True)
    e.prefill_attention = "auto"
    print(f"prefill: the default (auto) runs attention in {engine.prefill_attention_for(e)} on this machine "
          f"(the model's dtype where at least {engine.PREFILL_MARGIN}x faster than fp32)", flush=True)


def context_table(v, contexts: list[int], rounds: int) -> None:
    e = engine.Engine(v.model)
    buf = tree_buffers(auto_tree(SHAPE_TABLE, NODES - 1))
    nodes = torch.randint(0, v.vocab_size, (1, NODES), generator=torch.Generator().manual_seed(1))
    one = nodes[:, :1]
    fns = {}
    for n in contexts:
        ids = torch.randint(0, v.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        cache = engine.new_cache(e, n + 64 + NODES)
        engine.forward(cache, ids)

        def step(c=cache, n=n):
            engine.forward(c, one)
            c.length = n

        fns[f"step {n}"] = step
        fns[f"tree {n}"] = lambda c=cache: engine.forward(c, nodes, buf.positions, buf.mask)
    with torch.inference_mode():
        ms = least_ms(fns, rounds)
    first = contexts[0]
    print(f"context: {'prefix':>6} {'step ms':>8} {'x':>6} {'tree ms':>8} {'x':>6}")
    for n in contexts:
        s, t = ms[f"step {n}"], ms[f"tree {n}"]
        print(f"         {n:6d} {s:8.1f} {s / ms[f'step {first}']:5.2f}x {t:8.1f} {t / ms[f'tree {first}']:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", choices=["prefill", "context"], default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    v = load_smollm2(dtype=args.dtype, device="cpu")
    peak = max(machine((args.dtype,))["peak_gflops"][args.dtype] for _ in range(3))  # a burst of load lowers one
    flags = sorted(f for f in ("amx_bf16", "avx512_bf16") if f in open("/proc/cpuinfo").read())
    print(f"{v.name}, {args.dtype}, {args.threads} thread(s), CPU flags {flags or 'none'}, matmul peak "
          f"{peak:.0f} GFLOP/s")
    if args.skip != "prefill":
        prefill_table(v, args.lengths, args.rounds, peak)
    if args.skip != "context":
        context_table(v, args.contexts, args.rounds)


if __name__ == "__main__":
    main()

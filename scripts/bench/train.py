"""Training-side throughput, measured side by side in one process.

    python -m scripts.bench.train                      # default verifier, 16 prompts, 64 new tokens
    python -m scripts.bench.train --prompts 32 --new-tokens 128 --steps 8
    python -m scripts.bench.train --generation-only --dtype bfloat16 --threads 2 --prompts 400 --new-tokens 256 \
        --batch-size 128

1. Self-distillation (answer tokens/s, greedy, same prompts): refill batching on the slot cache
   (`data.generate.generate_refill`, what data building uses), on HF's DynamicCache, and one prompt at a time
   (`model.generate`, on the first --single-prompts prompts); `--paths` adds fixed batches and F.linear.
2. Training: Medusa forward + backward + optimizer step in fp32 vs bf16 autocast (tokens/s, same batches).
Prints ratios; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from data.chat import prompt_ids
from data.datamodule import collate
from data.generate import generate_refill
from data.prompts import load_conversations
from data.selfdistill import generate_answers
from scripts.common import add_verifier_args, load_cpu_verifier, set_threads
from train.medusa import MedusaModule

GEN_PATHS = {
    "slots": "refill batching on the slot cache (data/generate.py, what data building uses)",
    "dynamic": "refill batching on HF's DynamicCache (the previous path)",
    "unpacked": "refill batching, slot cache, F.linear instead of prepacked linears",
    "fixed": "fixed batches of model.generate",
    "single": "one prompt at a time, model.generate",
}


def bench_generation(verifier, prompts: list[list[int]], new_tokens: int, batch_size: int,
                     paths: list[str], single_prompts: int) -> dict[str, dict[str, float]]:
    """Answer tokens/s of each path in `paths` (GEN_PATHS), greedy, in this process; "single" answers only the
    first `single_prompts` prompts (one at a time is slow), the others all of them."""
    # Warm up first (kernel selection, allocator): the first calls are not what we compare.
    generate_refill(verifier, prompts[:batch_size], 4, batch_size=batch_size)
    verifier.model.generate(torch.tensor([prompts[0]], device=verifier.device), max_new_tokens=4, do_sample=False,
                            top_k=None, top_p=None, pad_token_id=verifier.tokenizer.pad_token_id)
    out: dict[str, dict[str, float]] = {}
    answers: dict[str, list[list[int]]] = {}
    for path in paths:
        t0 = time.perf_counter()
        if path in ("slots", "dynamic", "unpacked"):
            got = generate_refill(verifier, prompts, new_tokens, batch_size=batch_size, slots=path != "dynamic",
                                  pack=path != "unpacked")
        elif path == "fixed":
            got = generate_answers(verifier, prompts, new_tokens, 0.0, batch_size, seed=0, desc="fixed")
        elif path == "single":
            got = []
            for p in prompts[:single_prompts]:
                ids = verifier.model.generate(torch.tensor([p], device=verifier.device), max_new_tokens=new_tokens,
                                              do_sample=False, top_k=None, top_p=None,
                                              pad_token_id=verifier.tokenizer.pad_token_id)
                got.append(ids[0, len(p):].tolist())
        else:
            raise SystemExit(f"--paths: unknown path {path!r}; choose from {', '.join(GEN_PATHS)}")
        seconds = time.perf_counter() - t0
        tokens = sum(len(a) for a in got)
        answers[path] = got
        out[path] = {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "prompts": len(got)}
    if "slots" in answers:  # bf16 rounding differs between paths, so greedy answers can part at near-ties
        for path, got in answers.items():
            out[path]["same_as_slots"] = sum(a == b for a, b in zip(got, answers["slots"]))
    return out


def bench_training(verifier, batches: list[dict[str, torch.Tensor]], steps: int, bf16: bool) -> float:
    module = MedusaModule(verifier, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    opt = module.configure_optimizers()
    tokens, elapsed = 0, 0.0
    for step in range(steps + 1):  # step 0 warms up and is not timed
        batch = batches[step % len(batches)]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = module.model_step(batch)[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            elapsed += time.perf_counter() - t0
            tokens += int(batch["attention_mask"].sum())
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_verifier_args(ap, threads_help="torch threads (1 is faster on a shared, loaded box)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--generation-only", action="store_true", help="skip the training benchmark")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="only this verifier dtype (generation)")
    ap.add_argument("--paths", default="slots,dynamic,single",
                    help=f"generation paths, comma-separated, from: {', '.join(GEN_PATHS)}")
    ap.add_argument("--single-prompts", type=int, default=16,
                    help="generation: prompts the one-at-a-time path answers (the others answer --prompts)")
    args = ap.parse_args()
    torch.manual_seed(0)
    set_threads(args)

    if args.generation_only:
        convs = load_conversations("builtin", split="train", limit=args.prompts)
        paths = args.paths.split(",")
        print(f"load average before: {os.getloadavg()}")
        for dtype in [args.dtype] if args.dtype else ["float32", "bfloat16"]:
            verifier = load_cpu_verifier(args, dtype)
            prompts = [prompt_ids(verifier.tokenizer, c.messages) for c in convs]
            g = bench_generation(verifier, prompts, args.new_tokens, args.batch_size, paths, args.single_prompts)
            print(f"verifier {dtype} prompts={len(prompts)} ({sum(map(len, prompts))} prompt tokens) "
                  f"new_tokens={args.new_tokens} batch={args.batch_size} threads={torch.get_num_threads()}")
            base = g.get("single", {}).get("tok_s")
            for path, r in g.items():
                vs = f"{r['tok_s'] / base:6.2f}x one at a time" if base else ""
                same = f"  same answers as slots: {r['same_as_slots']}/{r['prompts']}" if "same_as_slots" in r else ""
                print(f"  {path:<9}{r['tok_s']:8.1f} tok/s  {r['tokens']:7d} tokens {r['seconds']:7.1f} s  {vs}{same}"
                      f"   ({GEN_PATHS[path]})")
        print(f"load average after: {os.getloadavg()}")
        return

    convs = load_conversations("builtin", split="train", limit=args.prompts)
    rows = []
    for dtype in ("float32", "bfloat16"):
        verifier = load_cpu_verifier(args, dtype)
        prompts = [prompt_ids(verifier.tokenizer, c.messages) for c in convs]
        gen = bench_generation(verifier, prompts, args.new_tokens, args.batch_size, ["slots", "single"],
                               args.single_prompts)
        rows.append((f"self-distillation, verifier {dtype}", gen["slots"]["tok_s"], gen["single"]["tok_s"]))
        if dtype == "float32":
            answers = generate_answers(verifier, prompts, args.new_tokens, 0.0, args.batch_size, 0, desc="data")
            examples = [{"input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a)}
                        for p, a in zip(prompts, answers)]
            pad = verifier.tokenizer.pad_token_id
            batches = [collate(examples[i : i + 8], pad) for i in range(0, len(examples), 8)]
            fp32 = bench_training(verifier, batches, args.steps, bf16=False)
    verifier = load_cpu_verifier(args, "bfloat16")
    bf16 = bench_training(verifier, batches, args.steps, bf16=True)

    print(f"\nverifier={args.verifier} prompts={args.prompts} new_tokens={args.new_tokens} torch={torch.__version__} "
          f"threads={torch.get_num_threads()}")
    print(f"{'self-distillation':<36}{'batched tok/s':>15}{'one-by-one tok/s':>18}{'ratio':>8}")
    for name, batched, single in rows:
        print(f"{name:<36}{batched:>15.1f}{single:>18.1f}{batched / single:>7.2f}x")
    print(f"{'training (Medusa, 4 heads)':<36}{'fp32 tok/s':>15}{'bf16 tok/s':>18}{'ratio':>8}")
    print(f"{'verifier fwd + heads fwd/bwd':<36}{fp32:>15.1f}{bf16:>18.1f}{bf16 / fp32:>7.2f}x")


if __name__ == "__main__":
    main()

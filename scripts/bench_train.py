"""Training-side throughput, measured side by side in one process.

    python scripts/bench_train.py                      # default verifier, 16 prompts, 64 new tokens
    python scripts/bench_train.py --prompts 32 --new-tokens 128 --steps 8
    python scripts/bench_train.py --generation-only --dtype bfloat16 --prompts 48 --new-tokens 256 --batch-size 48

1. Self-distillation: refill batching (`data.generate.generate_refill`, what data building uses), fixed batches of
   `model.generate` (the previous path), and one-prompt-at-a-time `model.generate` (tokens/s, same prompts).
2. Training: Medusa forward + backward + optimizer step in fp32 vs bf16 autocast (tokens/s, same batches).
Prints ratios; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.chat import prompt_ids  # noqa: E402
from data.datamodule import collate  # noqa: E402
from data.prompts import load_conversations  # noqa: E402
from data.generate import generate_refill  # noqa: E402
from data.selfdistill import generate_answers  # noqa: E402
from models.verifier import build_tiny, load_smollm2  # noqa: E402
from train.medusa import MedusaModule  # noqa: E402


def bench_generation(verifier, prompts: list[list[int]], new_tokens: int, batch_size: int,
                     single: bool = True) -> dict[str, float]:
    # Warm up both paths first (kernel selection, allocator): the first calls are not what we compare.
    generate_answers(verifier, prompts[:batch_size], 4, 0.0, batch_size, seed=0, desc="warm-up")
    verifier.model.generate(torch.tensor([prompts[0]], device=verifier.device), max_new_tokens=4, do_sample=False,
                            top_k=None, top_p=None, pad_token_id=verifier.tokenizer.pad_token_id)
    if single:
        t0 = time.perf_counter()
        answers = generate_answers(verifier, prompts, new_tokens, 0.0, batch_size, seed=0, desc="batched")
        batched_s = time.perf_counter() - t0
        batched_tokens = sum(len(a) for a in answers)
    generate_refill(verifier, prompts[:batch_size], 4, batch_size=batch_size)
    t0 = time.perf_counter()
    refill = generate_refill(verifier, prompts, new_tokens, batch_size=batch_size)
    refill_s = time.perf_counter() - t0
    refill_tokens = sum(len(a) for a in refill)
    t0 = time.perf_counter()
    unpacked = generate_refill(verifier, prompts, new_tokens, batch_size=batch_size, pack=False)
    unpacked_s = time.perf_counter() - t0
    out = {"refill_tok_s": refill_tokens / refill_s, "tokens": refill_tokens,
           "unpacked_tok_s": sum(len(a) for a in unpacked) / unpacked_s, "same_tokens": unpacked == refill}
    if not single:
        return out
    t0 = time.perf_counter()
    single_tokens = 0
    for p in prompts:
        out = verifier.model.generate(torch.tensor([p], device=verifier.device), max_new_tokens=new_tokens,
                                      do_sample=False, top_k=None, top_p=None,
                                      pad_token_id=verifier.tokenizer.pad_token_id)
        single_tokens += out.shape[1] - len(p)
    single_s = time.perf_counter() - t0
    return out | {"batched_tok_s": batched_tokens / batched_s, "single_tok_s": single_tokens / single_s}


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
    ap.add_argument("--verifier", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cache-dir", default=os.environ.get("SPECDRAFT_CACHE"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 is faster on a shared, loaded box)")
    ap.add_argument("--generation-only", action="store_true", help="skip the training benchmark")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="only this verifier dtype (generation)")
    ap.add_argument("--refill-only", action="store_true",
                    help="generation: only refill batching, prepacked linears against F.linear")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.generation_only:
        load = load_smollm2 if args.verifier == "smollm2" else build_tiny
        convs = load_conversations("builtin", split="train", limit=args.prompts)
        print(f"load average before: {os.getloadavg()}")
        for dtype in [args.dtype] if args.dtype else ["float32", "bfloat16"]:
            verifier = load(cache_dir=args.cache_dir, dtype=dtype, device="cpu")
            prompts = [prompt_ids(verifier.tokenizer, c.messages) for c in convs]
            g = bench_generation(verifier, prompts, args.new_tokens, args.batch_size, single=not args.refill_only)
            print(f"verifier {dtype} prompts={args.prompts} new_tokens={args.new_tokens} batch={args.batch_size} "
                  f"threads={torch.get_num_threads()} answer tokens={g['tokens']}")
            print(f"  refill batching, prepacked linears {g['refill_tok_s']:8.1f} tok/s  "
                  f"{g['refill_tok_s'] / g['unpacked_tok_s']:5.2f}x F.linear's, same tokens: {g['same_tokens']}")
            print(f"  refill batching, F.linear          {g['unpacked_tok_s']:8.1f} tok/s")
            if not args.refill_only:
                ratio = g['batched_tok_s'] / g['single_tok_s']
                print(f"  fixed batches     {g['batched_tok_s']:8.1f} tok/s  {ratio:5.2f}x")
                print(f"  one at a time     {g['single_tok_s']:8.1f} tok/s  1.00x  (refill: "
                      f"{g['refill_tok_s'] / g['single_tok_s']:.2f}x)")
        print(f"load average after: {os.getloadavg()}")
        return

    load = load_smollm2 if args.verifier == "smollm2" else build_tiny
    convs = load_conversations("builtin", split="train", limit=args.prompts)
    rows = []
    for dtype in ("float32", "bfloat16"):
        verifier = load(cache_dir=args.cache_dir, dtype=dtype, device="cpu")
        prompts = [prompt_ids(verifier.tokenizer, c.messages) for c in convs]
        gen = bench_generation(verifier, prompts, args.new_tokens, args.batch_size)
        rows.append((f"self-distillation, verifier {dtype}", gen["batched_tok_s"], gen["single_tok_s"]))
        if dtype == "float32":
            answers = generate_answers(verifier, prompts, args.new_tokens, 0.0, args.batch_size, 0, desc="data")
            examples = [{"input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a)} for p, a in zip(prompts, answers)]
            pad = verifier.tokenizer.pad_token_id
            batches = [collate(examples[i : i + 8], pad) for i in range(0, len(examples), 8)]
            fp32 = bench_training(verifier, batches, args.steps, bf16=False)
    verifier = load(cache_dir=args.cache_dir, dtype="bfloat16", device="cpu")
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

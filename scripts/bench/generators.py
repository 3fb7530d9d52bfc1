"""The two self-distillation generators side by side: this process's batched refill generation (data.generator=hf)
and the real vLLM's offline batched generation (data.generator=vllm), on the same prompts, greedy.

    python -m scripts.bench.generators --num 64 --max-new-tokens 128 --dtype bfloat16

Prints answer tokens/s of each (vLLM's with and without its model load) and how many answers are equal token for
token (up to and including the first EOS).
"""

from __future__ import annotations

import argparse
import time

from data.chat import prompt_ids
from data.generate import generate_refill
from data.prompts import load_conversations
from data.selfdistill import first_turn, stop_at
from models.verifiers.embedded import load_smollm2
from serve import vllm_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    verifier = load_smollm2(dtype=args.dtype, device="cpu")
    convs = load_conversations("builtin", split="train", limit=args.num)
    prompts = [prompt_ids(verifier.tokenizer, first_turn(c)) for c in convs]
    eos = verifier.tokenizer.eos_token_id

    answers: dict[int, list[int]] = {}
    start = time.perf_counter()
    generate_refill(verifier, prompts, args.max_new_tokens, 0.0, 1.0, args.batch_size, 0,
                    on_done=lambda j, a: answers.__setitem__(j, a), order="given")
    hf_s = time.perf_counter() - start
    hf = [answers[j] for j in range(len(prompts))]

    start = time.perf_counter()
    run = vllm_engine.serve(verifier.checkpoint, prompts, args.max_new_tokens, dtype=args.dtype, warmup=False,
                            batch=True, max_model_len=max(map(len, prompts)) + args.max_new_tokens + 8)
    total_s = time.perf_counter() - start
    ours = [stop_at(a, eos) for a in run.outputs]
    hf_tokens, vllm_tokens = sum(map(len, hf)), sum(map(len, ours))
    same = sum(a == b for a, b in zip(hf, ours))
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens max, {args.dtype}, greedy")
    print(f"hf (refill, batch {args.batch_size}): {hf_tokens} tokens in {hf_s:.1f} s = {hf_tokens / hf_s:.1f} tok/s")
    print(f"vllm {run.version} (offline batched): {vllm_tokens} tokens in {run.seconds:.1f} s = "
          f"{vllm_tokens / run.seconds:.1f} tok/s; {total_s:.1f} s with start-up and model load "
          f"({vllm_tokens / total_s:.1f} tok/s)")
    print(f"answers equal token for token: {same} / {len(prompts)}")


if __name__ == "__main__":
    main()

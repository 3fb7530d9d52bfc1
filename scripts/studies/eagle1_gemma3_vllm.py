"""A trained EAGLE-1 on Gemma 3 270M, ours against the real vLLM 0.32: per-position acceptance (eval's exact decoder,
fp32, chains of 3, against vLLM's `--speculative-config method=eagle`) on 6 eval-split prompts rendered plain, and
the same weights drafting from Hugging Face's scaled embedding as a control (docs/results/gemma3.md).

    python train.py verifier=gemma3 model=eagle data=shipped data.shipped=gemma3-selfdistill-v1 data.limit=300 \\
        data.cache_hidden_states=true trainer.max_epochs=1 logger=csv name=g3-eagle1-raw
    python -m scripts.studies.eagle1_gemma3_vllm outputs/g3-eagle1-raw/export
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from data.chat import prompt_ids
from data.prompts import load_conversations
from eval.drafters.build import make_drafter
from eval.engine.decode import speculative_decode
from eval.engine.tree import Chain
from models.verifiers.embedded import load_gemma3
from serve import vllm_engine

K, MAX_NEW, PROMPTS = 3, 64, 6


def _alpha(verifier, drafter, prompts) -> tuple[list[float], int, list[list[int]]]:
    lengths, outs = [], []
    for ids in prompts:
        res = speculative_decode(verifier, drafter, torch.tensor([ids]), MAX_NEW,
                                 eos_token_id=verifier.tokenizer.eos_token_id)
        lengths.append(res.accept_lengths[:, 0])
        outs.append(res.tokens[0].tolist())
    rounds = torch.cat(lengths)
    return [float((rounds >= k).float().mean()) for k in range(1, K + 1)], rounds.numel(), outs


def _tolerance(p: float, n_ours: int, n_vllm: int) -> float:
    """tests/test_engine_vllm.py's: four standard errors of the difference, plus a round's weight on each side."""
    q = min(max(p, 0.05), 0.95)
    return 4 * math.sqrt(q * (1 - q) * (1 / n_ours + 1 / n_vllm)) + 1 / n_ours + 1 / n_vllm


def _compare(label: str, ours: list[float], rounds: int, theirs: list[float], drafts: int) -> None:
    print(f"{label}: alpha {[round(a, 3) for a in ours]} over {rounds} rounds; vLLM {[round(b, 3) for b in theirs]} "
          f"over {drafts} drafts")
    for k, (a, b) in enumerate(zip(ours, theirs), start=1):
        tol = _tolerance((a + b) / 2, rounds, drafts)
        where = "within" if abs(a - b) <= tol else "outside"
        print(f"  alpha_{k}: |diff| {abs(a - b):.3f}, tolerance {tol:.3f}: {where}")


def main(export: Path) -> None:
    verifier = load_gemma3(dtype="float32", device="cpu")
    convs = load_conversations("builtin", split="eval", limit=PROMPTS)
    prompts = [prompt_ids(verifier.tokenizer, [{"role": "user", "content": c.user_turns[0]}], verifier.rendering)
               for c in convs]
    drafter = make_drafter("eagle", verifier, Chain(K), checkpoint=export)
    ours, rounds, outs = _alpha(verifier, drafter, prompts)
    run = vllm_engine.serve(verifier.checkpoint, prompts, MAX_NEW, dtype="float32",
                            spec=vllm_engine.speculative_config("eagle", export, K))
    _compare("ours (raw embedding table)", ours, rounds, run.alpha, run.spec["num_drafts"])
    print(f"greedy outputs equal on {sum(a == b for a, b in zip(outs, run.outputs))} of {len(prompts)} prompts")
    drafter.embed = verifier.model.get_input_embeddings()  # the control: Hugging Face's scaled embedding
    scaled, rounds, _ = _alpha(verifier, drafter, prompts)
    _compare("control (scaled embedding)", scaled, rounds, run.alpha, run.spec["num_drafts"])


if __name__ == "__main__":
    main(Path(sys.argv[1]))

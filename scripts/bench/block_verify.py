"""What block verification adds to tau, measured on the same drafts: both rules' exact expectations, round by round.

    python -m scripts.bench.block_verify [--checkpoint pretrained/eagle3-smollm2] [--prompts 8] [--tokens 96]
                                         [--temperature 0.7] [--depth 5] [--threads 1]

Decodes the first prompts of the eval split with speculative decoding (verify=token, a chain of the export's drafts),
records every round's drafted chain, and scores each chain under both rules exactly: E[drafts accepted] from the
token rule's law (eval.engine.sampling.outcome_distribution) and from block verification's
(eval.engine.block_verify.block_outcome_distribution), q from one verifier forward over the sequence and the chain.
The paired difference has far less noise than two sampled runs' taus. Printed for top-1 drafts and sampled drafts
(sampled_drafts=true); expected tau = 1 + E[drafts accepted]. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from data.chat import prompt_ids
from data.prompts import load_conversations, select_prompts
from eval.drafters.build import export
from eval.engine.block_verify import block_outcome_distribution, block_plan
from eval.engine.decode import speculative_decode
from eval.engine.sampling import SamplingConfig, outcome_distribution, rejection_plan, warp
from eval.engine.tree import Chain
from eval.runner import user_turns
from models.verifier import load_smollm2

ROOT = Path(__file__).resolve().parents[2]


def expected_accepts(verifier, rounds, cfg: SamplingConfig) -> tuple[list[float], list[float]]:
    """(token rule, block rule): E[drafts accepted] for each recorded round (sequence, draft)."""
    token, block = [], []
    for sequence, draft in rounds:
        ids = torch.cat([sequence, draft.tokens[:, 1:]], dim=1)  # the root is the sequence's last token
        logits = verifier.model(ids).logits[:, sequence.shape[1] - 1:]  # (1, N, V) q at every node of the chain
        q = warp(logits, cfg.temperature, cfg.top_p, cfg.top_k).double()
        p = None if draft.p is None else draft.p.double()
        reach, _ = outcome_distribution(rejection_plan(draft.tree.parents, draft.tokens, q, p))
        token.append(float(reach[0, 1:].sum()))  # a chain: E[tau] = sum over drafts of P(accepted)
        law = block_outcome_distribution(block_plan(draft.tokens, q, p)).sum(-1)[0]  # (N,) P(tau = n)
        block.append(float((law * torch.arange(len(law), dtype=law.dtype)).sum()))
    return token, block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "pretrained" / "eagle3-smollm2"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--depth", type=int, default=None, help="drafts per chain (default: the drafter's own)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    verifier = load_smollm2(dtype=args.dtype, device="cpu")
    cfg = SamplingConfig(temperature=args.temperature)
    convs = select_prompts(load_conversations("builtin", split="eval"), args.prompts)
    prompts = [torch.tensor([prompt_ids(verifier.tokenizer, user_turns(c)[0])]) for c in convs]
    print(f"{Path(args.checkpoint).name}, tree=chain, temperature {args.temperature}, {len(prompts)} prompts x "
          f"{args.tokens} tokens, {args.dtype}")
    for sampled in (False, True):
        proposals = {"sampling": cfg, "generator": torch.Generator().manual_seed(args.seed + 1)} if sampled else {}
        drafter = export(verifier, Chain(args.depth), args.checkpoint, **proposals)
        rounds: list = []
        propose = drafter.propose
        drafter.propose = lambda s, h: rounds.append((s, propose(s, h))) or rounds[-1][1]  # record, not replace
        gen = torch.Generator().manual_seed(args.seed)
        with torch.inference_mode():
            taus = [speculative_decode(verifier, drafter, x, args.tokens, sampling=cfg, generator=gen).tau
                    for x in prompts]
            token, block = expected_accepts(verifier, rounds, cfg)
        n = len(token)
        diff = [b - t for t, b in zip(token, block)]
        mean = sum(diff) / n
        sem = math.sqrt(sum((d - mean) ** 2 for d in diff) / (n - 1) / n)
        print(f"{'sampled' if sampled else 'top-1'} drafts (depth {drafter.max_depth}): {n} rounds, measured tau "
              f"(token rule) {sum(taus) / len(taus):.3f}; expected tau per round: token {1 + sum(token) / n:.4f}, "
              f"block {1 + sum(block) / n:.4f}, block - token {mean:+.4f} +- {sem:.4f} (s.e.), "
              f"max {max(diff):+.4f}, min {min(diff):+.4f}")


if __name__ == "__main__":
    main()

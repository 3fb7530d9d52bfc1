"""What block verification adds to tau, measured on the same drafts: both rules' exact expectations, round by round.

    python -m scripts.bench.block_verify [--checkpoint pretrained/eagle3-smollm2] [--prompts 8] [--tokens 96]
                                         [--temperature 0.7] [--depth 5] [--threads 1]

Decodes the first prompts of the eval split with speculative decoding (verify=token, a chain of the export's drafts),
records every round's drafted chain, and scores each chain under both rules exactly: E[drafts accepted] from the
token rule's law (eval.engine.acceptance.sampled.outcome_distribution) and from block verification's
(eval.engine.acceptance.block.block_outcome_distribution), q from one verifier forward over the sequence and the chain.
The paired difference has far less noise than two sampled runs' taus. Printed for top-1 drafts and sampled drafts
(sampled_drafts=true); expected tau = 1 + E[drafts accepted]. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from data.chat import prompt_ids
from data.prompts import load_conversations, select_prompts
from eval.drafters.build import export
from eval.engine.acceptance.block import block_outcome_distribution, block_plan
from eval.engine.acceptance.sampled import outcome_distribution, rejection_plan
from eval.engine.decode import speculative_decode
from eval.engine.sampling import SamplingConfig, warp
from eval.engine.tree import Chain
from eval.runner import user_turns
from models.verifiers.embedded import load_smollm2

ROOT = Path(__file__).resolve().parents[2]


def expected_accepts(verifier, rounds, cfg: SamplingConfig) -> tuple[list[list[float]], list[float]]:
    """Per recorded round (sequence, draft): P(draft k accepted) for every k under the token rule (their sum is
    E[drafts accepted]), and E[drafts accepted] under block verification."""
    token, block = [], []
    for sequence, draft in rounds:
        ids = torch.cat([sequence, draft.tokens[:, 1:]], dim=1)  # the root is the sequence's last token
        logits = verifier.model(ids).logits[:, sequence.shape[1] - 1:]  # (1, N, V) q at every node of the chain
        q = warp(logits, cfg.temperature, cfg.top_p, cfg.top_k).double()
        p = None if draft.p is None else draft.p.double()
        reach, _ = outcome_distribution(rejection_plan(draft.tree.parents, draft.tokens, q, p))
        token.append(reach[0, 1:].tolist())  # a chain: node k is reached iff drafts 1..k are accepted
        law = block_outcome_distribution(block_plan(draft.tokens, q, p)).sum(-1)[0]  # (N,) P(tau = n)
        block.append(float((law * torch.arange(len(law), dtype=law.dtype)).sum()))
    return token, block


def paired_rules(verifier, checkpoint: str, prompts: list[torch.Tensor], cfg: SamplingConfig, tokens: int,
                 depth: int | None, seed: int, sampled: bool) -> dict[str, Any]:
    """Decode `prompts` with the export's chain drafter (verify=token; top-1 drafts, or sampled ones), record every
    round's chain and score each under both rules exactly. Returns the rounds, the measured tau, E[tau] per round under
    each rule, the token rule's standard error, and block - token with its standard error (paired, per round)."""
    proposals = {"sampling": cfg, "generator": torch.Generator().manual_seed(seed + 1)} if sampled else {}
    drafter = export(verifier, Chain(depth), checkpoint, **proposals)  # type: ignore[arg-type]
    rounds: list = []
    propose = drafter.propose

    def recording(sequence, hidden):  # record, not replace
        rounds.append((sequence, propose(sequence, hidden)))
        return rounds[-1][1]

    drafter.propose = recording  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        taus = [speculative_decode(verifier, drafter, x, tokens, sampling=cfg, generator=gen).tau for x in prompts]
        per_position, block = expected_accepts(verifier, rounds, cfg)
    token = [sum(r) for r in per_position]
    n = len(token)
    depth = max(map(len, per_position), default=0)

    def mean_sem(xs: list[float]) -> tuple[float, float]:
        mean = sum(xs) / n
        return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / max(n - 1, 1) / n)

    tok, tok_sem = mean_sem(token)
    diff, diff_sem = mean_sem([b - t for t, b in zip(token, block)])
    return {"rounds": n, "depth": drafter.max_depth, "measured_tau": sum(taus) / len(taus),
            "expected_tau_token": 1 + tok, "expected_tau_token_sem": tok_sem, "expected_tau_block": 1 + sum(block) / n,
            "block_minus_token": diff, "block_minus_token_sem": diff_sem,
            "block_minus_token_max": max(b - t for t, b in zip(token, block)),
            "block_minus_token_min": min(b - t for t, b in zip(token, block)),
            "accept_rate_per_position": [sum(r[k] for r in per_position if len(r) > k) / n for k in range(depth)]}


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
        r = paired_rules(verifier, args.checkpoint, prompts, cfg, args.tokens, args.depth, args.seed, sampled)
        print(f"{'sampled' if sampled else 'top-1'} drafts (depth {r['depth']}): {r['rounds']} rounds, measured tau "
              f"(token rule) {r['measured_tau']:.3f}; expected tau per round: token {r['expected_tau_token']:.4f}, "
              f"block {r['expected_tau_block']:.4f}, block - token {r['block_minus_token']:+.4f} +- "
              f"{r['block_minus_token_sem']:.4f} (s.e.), max {r['block_minus_token_max']:+.4f}, "
              f"min {r['block_minus_token_min']:+.4f}")


if __name__ == "__main__":
    main()

"""The decode loops: plain greedy and plain sampling (our baselines, one token per verifier forward) and
speculative decoding, greedy or sampled (eval.engine.sampling: exact for the warped verifier distribution).

Both share one verifier path, so their difference is the drafting alone: eval.engine.forward (batch-invariant forward,
preallocated KV cache; exact in bf16) for the Llama-family verifiers it runs, else Hugging Face's forward through
eval.engine.hf_forward (`engine=auto|engine|hf`: eval.engine.session, which holds the verifier's side of a decode,
`VerifierSession`, and the choice, `use_engine`). Speculative decoding costs one
verifier forward per round: the outputs at the last accepted node (its logits choose the next root, its hidden
state feeds the drafter) come out of the tree forward itself, never from an extra forward.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from eval.engine.acceptance import rule_for
from eval.engine.acceptance.block import check_chain_drafters
from eval.engine.acceptance.protocol import mean_accept_length, per_position_acceptance
from eval.engine.protocol import Draft, Drafter, Observing
from eval.engine.sampling import SamplingConfig, warp
from eval.engine.session import VerifierSession, check_inputs
from eval.engine.tree import Tree, TreeBuffers, tree_buffers, truncate
from models.verifiers.core import Verifier


@dataclass
class DecodeResult:
    """tokens: (B, n) new tokens, cut at max_new_tokens and after the first EOS.
    num_forwards: verifier forwards, the prefill included.
    accept_lengths: (R, B) tokens each round emitted, minus one: the drafts accepted, bonus excluded. Only what is
        kept counts: the last round verifies no draft past max_new_tokens, and an EOS cuts what follows it.
    times: seconds spent in prefill (the verifier's forward over the prompt), verify (its later forwards), draft,
        accept, commit (KV gather), and total.
    """

    tokens: Tensor
    num_forwards: int
    accept_lengths: Tensor
    max_depth: int = 0
    times: dict[str, float] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Tokens per verifier forward over the decoding rounds, bonus included (the prefill is not a round)."""
        return mean_accept_length(self.accept_lengths)

    @property
    def alpha(self) -> Tensor:
        """alpha_k, k = 1..max_depth: fraction of rounds whose k-th draft was accepted. (max_depth,)"""
        return per_position_acceptance(self.accept_lengths, self.max_depth)


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.sync()  # kernels are asynchronous on a GPU: without a sync the time lands in the wrong bucket
        start = time.perf_counter()
        yield
        self.sync()
        self.totals[name] += time.perf_counter() - start


class _Output:
    """New tokens so far, cut exactly at max_new_tokens and right after an EOS."""

    def __init__(self, max_new_tokens: int, eos_token_id: int | Sequence[int] | None) -> None:
        self.tokens: list[int] = []
        self.budget = max_new_tokens
        self.eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        self.done = max_new_tokens == 0

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)

    def extend(self, new: Tensor) -> int:
        """Append what fits before the cut; returns how many tokens of `new` were kept."""
        before = len(self.tokens)
        for token in new.flatten().tolist():
            if self.done:
                break
            self.tokens.append(token)
            self.done = len(self.tokens) >= self.budget or token in self.eos
        return len(self.tokens) - before


def _truncate(draft: Draft, depth: int) -> tuple[Draft, Tensor]:
    """`draft` without its nodes deeper than `depth`, and the kept nodes' indices (K,) in `draft.tree`."""
    tree, keep = truncate(draft.tree, depth)
    index = torch.tensor(keep, device=draft.tokens.device)
    return Draft(tree=tree, tokens=draft.tokens[:, index], p=None if draft.p is None else draft.p[:, index]), index


def _result(
    input_ids: Tensor, out: _Output, forwards: int, lengths: list[Tensor], depth: int, timer: _Timer, start: float
) -> DecodeResult:
    times = {f"{k}_s": v for k, v in timer.totals.items()} | {"total_s": time.perf_counter() - start}
    return DecodeResult(
        tokens=torch.tensor([out.tokens], dtype=input_ids.dtype, device=input_ids.device),  # (1, n)
        num_forwards=forwards,
        accept_lengths=torch.stack(lengths) if lengths else torch.zeros(0, 1, dtype=torch.long),  # (R, B)
        max_depth=depth,
        times=times,
    )


@torch.inference_mode()
def greedy_decode(
    verifier: Verifier,
    input_ids: Tensor,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    engine: str = "auto",
) -> DecodeResult:
    """Plain greedy decoding, one verifier forward per token, through the same cache code as speculative_decode."""
    return sample_decode(verifier, input_ids, max_new_tokens, eos_token_id, None, None, engine)


def _sampled(sampling: SamplingConfig | None) -> SamplingConfig | None:
    """None for greedy decoding (no config, or temperature 0)."""
    return None if sampling is None or sampling.greedy else sampling


def _draw(logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Tensor:
    """One token per row from the warped verifier distribution. (B, V) -> (B,)"""
    probs = warp(logits, sampling.temperature, sampling.top_p, sampling.top_k)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.inference_mode()
def sample_decode(
    verifier: Verifier, input_ids: Tensor, max_new_tokens: int, eos_token_id: int | Sequence[int] | None = None,
    sampling: SamplingConfig | None = None, generator: torch.Generator | None = None, engine: str = "auto",
) -> DecodeResult:
    """Plain decoding, one verifier forward per token, through the same cache code as speculative_decode: greedy
    (no config, or temperature 0), else a draw from the warped verifier -- the baseline each speculative mode is
    compared with (same output law, so speed is the only difference)."""
    sampling = _sampled(sampling)
    check_inputs(verifier, input_ids, max_new_tokens, 1, engine)
    start, timer, out = time.perf_counter(), _Timer(verifier.device), _Output(max_new_tokens, eos_token_id)
    cache, forwards, lengths = VerifierSession(verifier, engine, input_ids.shape[1] + max_new_tokens, 1, 0), 0, []
    token = input_ids
    while not out.done:
        # 1. One forward over the new token (the whole prompt the first time: the prefill); 2. the next token: the
        #    argmax, or a draw from warped q.
        with timer("verify" if forwards else "prefill"):
            step = cache.forward(token, last_logits=not forwards)
        forwards += 1
        last = step.logits[:, -1]  # (B, V)
        token = (last.argmax(dim=-1) if sampling is None else _draw(last, sampling, generator))[:, None]  # (B, 1)
        if forwards > 1:
            lengths.append(torch.zeros(token.shape[0], dtype=torch.long, device=token.device))
        out.extend(token)
    return _result(input_ids, out, forwards, lengths, 0, timer, start)


@torch.inference_mode()
def speculative_decode(
    verifier: Verifier,
    drafter: Drafter,
    input_ids: Tensor,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    sampling: SamplingConfig | None = None,
    generator: torch.Generator | None = None,
    engine: str = "auto",
) -> DecodeResult:
    """Speculative decoding with any drafter, over the chain or tree it proposes.

    Greedy (sampling None or temperature 0): token for token the output of plain greedy decoding with the verifier.
    Sampled: recursive rejection sampling (eval.engine.acceptance.sampled.sample_accept), whose output follows the
    warped verifier distribution exactly, as sample_decode's does (not the same tokens: other random draws); with
    `sampling.verify == "block"`, block verification of the drafted chain (eval.engine.acceptance.block), exact too.
    With `sampling.typical`, Medusa's typical acceptance instead: lossy. The rule is chosen once
    (eval.engine.acceptance). Fewer verifier forwards when the drafts are good.
    generator: the random source of the acceptance rule and the first token (the drafter has its own)."""
    sampling = _sampled(sampling)
    check_inputs(verifier, input_ids, max_new_tokens, drafter.max_nodes, engine)
    rule = rule_for(sampling)  # greedy, rejection sampling, typical or block (eval.engine.acceptance)
    check_chain_drafters(rule, [drafter])
    start, timer, out = time.perf_counter(), _Timer(verifier.device), _Output(max_new_tokens, eos_token_id)
    length = input_ids.shape[1] + max_new_tokens
    cache, lengths = VerifierSession(verifier, engine, length, drafter.max_nodes, drafter.max_depth), []
    buffers: dict[Tree, TreeBuffers] = {}
    layers = drafter.feature_layers  # the verifier hidden states the drafter reads (EAGLE-3: three layers)
    if out.done:
        return _result(input_ids, out, 0, lengths, drafter.max_depth, timer, start)

    # 1. Prefill: one forward over the prompt. Its last logits give the first root; its hidden states feed the drafter.
    with timer("prefill"):
        step = cache.forward(input_ids, layers=layers, last_logits=True)
    forwards = 1
    last = step.logits[:, -1]  # (B, V)
    root = last.argmax(dim=-1) if sampling is None else _draw(last, sampling, generator)  # (B,)
    hidden = step.hidden  # (B, T, len(layers) * D)
    sequence = torch.cat([input_ids, root[:, None]], dim=1)  # (B, T+1); the root is not in the cache yet
    out.extend(root)

    while not out.done:
        # 2. Draft: the drafter fills the tree under the root from the verifier's latest outputs.
        with timer("draft"):
            draft = drafter.propose(sequence, hidden)
        # The last round needs at most `remaining` tokens (drafts + the bonus): deeper nodes are not verified.
        kept = None  # (K,) the verified nodes' indices in the proposed tree, when it was truncated
        if draft.tree.max_depth > out.remaining - 1:
            draft, kept = _truncate(draft, out.remaining - 1)
        if draft.tree not in buffers:
            buffers[draft.tree] = tree_buffers(draft.tree, device=input_ids.device)
        buf = buffers[draft.tree]
        prefix_len = cache.length

        # 3. Verify: one forward over all nodes, each seeing the cached prefix and its own ancestors.
        with timer("verify"):
            step = cache.forward(draft.tokens, buf.positions, buf.mask, layers)  # logits (B, N, V)
        forwards += 1

        # 4. Accept: the run's rule (greedy: the longest path that matches the verifier's argmax; sampled: the
        #    recursive rejection walk over the tree, or verify=block's joint verdict on the chain). Either way the
        #    verifier adds one token after the accepted path.
        with timer("accept"):
            acc = rule.accept(buf.retrieve, draft, step.logits, generator)
            num = int(acc.num_accepted[0])
            nodes = buf.retrieve[acc.path, : num + 1]  # (B, 1+A): root, then the accepted drafts

        # 5. Commit: the cache keeps the root and the accepted drafts, contiguous after the prefix.
        with timer("commit"):
            cache.commit(prefix_len, nodes)

        # 6. Emit the accepted drafts and the verifier's next token, which becomes the next root.
        new = torch.cat([draft.tokens[:, nodes[0, 1:]], acc.next_token[:, None]], dim=1)  # (B, A+1)
        sequence = torch.cat([sequence, new], dim=1)
        lengths.append(acc.num_accepted.new_tensor([out.extend(new) - 1]))  # (B,): what the cut keeps

        # 7. Reuse this forward's outputs at the accepted nodes for the next round, and tell the drafter.
        hidden = step.hidden[:, nodes[0]]  # (B, 1+A, len(layers) * D)
        if kept is None and isinstance(drafter, Observing):  # lookahead learns from the logits at its nodes
            drafter.observe(draft.tokens, step.logits)
        drafter.accepted(acc.num_accepted, nodes if kept is None else kept[nodes])  # in the drafter's own tree

    return _result(input_ids, out, forwards, lengths, drafter.max_depth, timer, start)

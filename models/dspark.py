"""DSpark (arXiv 2607.05147; speculators 0.9's `dspark`, vLLM's `qwen3_dspark`): DFlash plus two small heads.

The backbone is DFlash's (models/dflash.py): one forward over a block [root, K mask tokens] gives K slot outputs
h_1..h_K, which the verifier's head turns into base logits. DSpark adds
- a Markov head, a low-rank logit bias from the token before each slot: slot k's logits are
  lm_head(h_k) + W2 W1[x_{k-1}] (x_0 the root), W1 (V, r) an embedding, W2 (r -> V) a projection (`vanilla`; the
  `gated` variant scales W1[x] by sigmoid(gate([h_k, W1[x]])), `rnn` keeps a recurrent state over the block, as
  speculators 0.9 defines them). Drafting is one backbone forward and K cheap bias steps, each slot conditioned on
  the token the slot before it drafted; training is teacher-forced on the previous target token.
- a confidence head, sigmoid(proj([h_k, W1[x_{k-1}]])): each slot's predicted acceptance probability, trained with
  BCE against the detached acceptance 1 - TV(p_k, q_k) = sum_v min(p, q) (train/dspark.py). The decoder cuts a
  round's proposal where the predicted cumulative acceptance falls below a threshold (eval/drafters/dspark.py).

The layout is vLLM's (qwen3_dspark: `markov_head.markov_w1`, `markov_head.markov_w2`, `confidence_head.proj` with
its bias, beside DFlash's tensors); the speculators `dspark` type with `sample_from_anchor: false` (the anchor is the
bonus token, the K = block_size - 1 masks draft), which is DFlash's convention here and vLLM's default for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from models.dflash import DFlashNet, check_block_size
from models.eagle import layer_config
from runtime.errors import UserError

MARKOV_HEADS = ("vanilla", "gated", "rnn")


def check_markov(rank: Any, head_type: Any, vocab_size: int, where: str = "model") -> tuple[int, str]:
    """A Markov rank is a whole number 1 <= r < V (a bias of rank >= V is no longer low-rank: it is a V x V table);
    the head type one of MARKOV_HEADS."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < vocab_size:
        raise UserError(f"{where}.markov_rank={rank!r}: the Markov bias W2 W1[x] has rank r with 1 <= r < the "
                        f"vocabulary ({vocab_size}); give such a whole number (speculators 0.9 trains 256).")
    if head_type not in MARKOV_HEADS:
        raise UserError(f"{where}.markov_head_type={head_type!r}: choose one of {list(MARKOV_HEADS)} (vLLM 0.32 "
                        f"serves vanilla).")
    return int(rank), str(head_type)


class MarkovHead(nn.Module):
    """The low-rank bias W2 W1[x] (speculators' MarkovHead, vLLM's DSparkMarkovHead), step by step."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str = "vanilla") -> None:
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":  # [gate; candidate; output] over [state; prev_emb; hidden]
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def embed(self, prev_ids: Tensor) -> Tensor:
        """W1[x] of the tokens before the slots. (..., r)"""
        return self.markov_w1(prev_ids.long())

    def step(self, emb: Tensor, hidden: Tensor, state: Tensor | None = None,
             w2: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """One slot's bias (..., V) from its previous token's W1 row `emb` (..., r) and its output `hidden` (..., D);
        `state` (..., r) the rnn variant's state from the slot before (None: zeros). Returns (bias, next state).
        `w2`: the r -> V product to use in place of `markov_w2` (the decoder's copy in the verifier head's dtype)."""
        w2 = self.markov_w2 if w2 is None else w2
        emb = emb.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return w2(emb), None
        hidden = hidden.to(emb.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1)))
            return w2(gate * emb), None
        state = emb.new_zeros(emb.shape) if state is None else state
        g, c, o = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        state = g * state + (1.0 - g) * torch.tanh(c)
        return w2(torch.tanh(o)), state

    def block(self, emb: Tensor, hidden: Tensor) -> Tensor:
        """Every slot's bias over blocks: emb (N, K, r), hidden (N, K, D) -> (N, K, V)."""
        if self.head_type != "rnn":
            return self.step(emb, hidden)[0]
        state, out = None, []
        for k in range(emb.shape[1]):
            bias, state = self.step(emb[:, k], hidden[:, k], state)
            out.append(bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    """The predicted acceptance of a slot's draft: logit = proj([h_k, W1[x_{k-1}]]) (vLLM: with its bias)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden: Tensor, emb: Tensor) -> Tensor:
        x = torch.cat([hidden.to(self.proj.weight.dtype), emb.to(self.proj.weight.dtype)], dim=-1)
        return self.proj(x).squeeze(-1)


class DSparkNet(DFlashNet):
    """DFlash's drafter with the Markov and confidence heads (module docstring)."""

    kind = "dspark"

    def __init__(self, *args: Any, markov_rank: int = 256, markov_head_type: str = "vanilla", **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.markov_rank, self.markov_head_type = check_markov(markov_rank, markov_head_type, self.vocab_size)
        self.markov_head = MarkovHead(self.vocab_size, self.markov_rank, self.hidden_size, self.markov_head_type)
        self.confidence_head = ConfidenceHead(self.hidden_size + self.markov_rank)

    def confidence_logit(self, hidden: Tensor, emb: Tensor) -> Tensor:
        """The confidence head's logit for slot outputs `hidden` (..., D) and their previous tokens' W1 rows."""
        return self.confidence_head(hidden, emb)


def build_dspark(verifier: Any, mask_token_id: int, block_size: int = 8, num_layers: int = 1,
                 aux_layer_ids: Sequence[int] | None = None, markov_rank: int = 256,
                 markov_head_type: str = "vanilla") -> DSparkNet:
    """A fresh DSpark drafter shaped like `verifier`'s layers; the block must fit the verifier's window."""
    window = getattr(verifier.config, "max_position_embeddings", None)
    return DSparkNet(mask_token_id=mask_token_id, block_size=check_block_size(block_size, window),
                     num_layers=num_layers, aux_layer_ids=aux_layer_ids, markov_rank=markov_rank,
                     markov_head_type=markov_head_type, **layer_config(verifier))

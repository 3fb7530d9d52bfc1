"""The sampling settings of a run (`SamplingConfig`, from its config: `sampling_config`) and `warp`, the one
warping of logits into probabilities (temperature, top-k, top-p) that plain sampling and every sampled acceptance
rule (eval.engine.acceptance) apply alike, so the guarantee holds for the warped verifier distribution, the one
plain sampling draws from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from runtime.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample. temperature 0 is greedy (the caller keeps the greedy rule); top_k 0 and top_p 1 disable those.
    typical: Medusa's typical acceptance (Cai et al., 2024) instead of rejection sampling -- LOSSY: its output does
    not follow the verifier's distribution. posterior_threshold / posterior_alpha are its epsilon / delta.
    verify: "token" (the default: rejection sampling draft by draft, chains and trees), "block" (block
    verification of a chain, eval.engine.acceptance.block: exact too, accepts at least as much) or a registered
    rule's name (eval.engine.acceptance.register; an unknown name is refused where the rule is named: named_rule,
    which eval.settings.parse calls before anything loads)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    typical: bool = False
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    verify: str = "token"

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise UserError(f"temperature={self.temperature} must be >= 0 (0 is greedy decoding, 1 samples from the "
                            f"verifier as it is).")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p} must be in (0, 1]; 1 keeps the whole distribution.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k={self.top_k!r} must be a whole number >= 0; 0 keeps every token.")
        if self.verify != "token" and self.typical:
            raise UserError(f"typical=true and verify={self.verify} are two acceptance rules; choose one "
                            f"(typical=false for verify={self.verify}, verify=token for Medusa's typical acceptance).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Probabilities from logits after temperature, then top-k, then top-p (nucleus: the smallest set of most likely
    tokens whose mass reaches top_p; the most likely token always stays), as HF's sampling warpers order them.
    Applied identically to q and p. temperature must be > 0 (0 is the caller's greedy rule). (..., V) -> (..., V)"""
    if temperature <= 0:
        raise ValueError("warp needs temperature > 0; temperature 0 is greedy decoding, handled by the caller.")
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)  # vocabulary order
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sampling_config(cfg: Any) -> SamplingConfig:
    """temperature / top_p / top_k / typical / verify / posterior_* from a run's config (any mapping with `.get`; a key
    it lacks takes SamplingConfig's default, the one place those are written), checked (SamplingConfig raises one
    UserError each)."""
    values = {f.name: cfg.get(f.name, f.default) for f in fields(SamplingConfig)}
    for key in ("temperature", "top_p", "top_k", "posterior_threshold", "posterior_alpha"):
        if isinstance(values[key], bool) or not isinstance(values[key], (int, float)):
            raise UserError(f"{key}={values[key]!r} must be a number.")
    if not isinstance(values["typical"], bool):  # a word stays a string, which bool() would take as true: lossy
        raise UserError(f"typical={values['typical']!r}: give true or false, e.g. typical=false.")
    return SamplingConfig(float(values["temperature"]), float(values["top_p"]), values["top_k"], values["typical"],
                          float(values["posterior_threshold"]), float(values["posterior_alpha"]), str(values["verify"]))

"""The planner's cost model (eval/planner/cost.py) extended to a batch of B requests: what K a drafter should draft
at each batch size, and the batch size past which speculation stops paying, predicted on this machine.

One decode step of B requests, each drafting K tokens, costs one verifier forward over B x (K + 1) tokens, t(B, K+1),
plus the drafting, d(B, K); plain decoding costs t(B, 1) a token per request. With E(K) = 1 + sum_{k<=K} prod_{j<=k}
alpha_j tokens emitted per request and step (alpha_j from the export's acceptance table: the top-1 rate at depth j,
the last depth's rate repeated past the table), the predicted speedup is

    speedup(B, K) = E(K) * t(B, 1) / (t(B, K+1) + d(B, K)),

the best K at B the argmax (K = 0, no drafting, where none exceeds 1), and the crossover the first B where no K pays.
t is measured here (`verify_costs`: the verifier's forward over a (B, w) batch after a cached B x P prefix, Hugging
Face's batched forward, the least of `reps`); d(B, K) = d(1, K) t(B, 1) / t(1, 1), the drafter's own batch-1 draft
curve (eval.planner.cost.draft_curve, through the drafter protocol) scaled as the verifier's step grows with the batch,
or 0 where the run measured none. What the serving engine adds around the forward (scheduling, sampling, the server) is
not in it; the measured table beside it shows how much that matters.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from eval.engine.timing import interleaved


def verify_costs(model: Any, prefix_ids: Tensor, batches: Sequence[int], widths: Sequence[int],
                 reps: int = 3) -> dict[tuple[int, int], float]:
    """ms of one forward of `model` (a Hugging Face causal LM) over (B, w) tokens after a cached (B, P) prefix, for
    every B in `batches` and w in `widths`: the verify step of B requests drafting w - 1 tokens each."""
    out: dict[tuple[int, int], float] = {}
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values
        for b in batches:
            ids = prefix_ids.to(model.device).repeat(b, 1)  # (B, P)
            cache = model(ids, use_cache=True).past_key_values

            def step(w: int) -> Any:
                x = ids[:, -w:]  # (B, w): which tokens does not change the cost

                def run() -> None:
                    model(x, past_key_values=cache, use_cache=True)
                    cache.crop(-w)  # back to the prefix (this transformers crops by tokens removed)

                return run

            for w, ms in zip(widths, interleaved([step(w) for w in widths], reps)):
                out[(b, w)] = ms
    return out


def smooth(costs: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """The measured costs read non-decreasing in the width at each batch size, then in the batch size at each width
    (eval.planner.cost.monotone: more tokens in one forward do at least the work of fewer; a dip is timing noise)."""
    from eval.planner.cost import monotone

    out = dict(costs)
    batches, widths = sorted({b for b, _ in costs}), sorted({w for _, w in costs})
    for b in batches:
        out |= dict(zip(((b, w) for w in widths), monotone([out[(b, w)] for w in widths])))
    for w in widths:
        out |= dict(zip(((b, w) for b in batches), monotone([out[(b, w)] for b in batches])))
    return out


def chain_alpha(table: Sequence[Sequence[float]] | None, k: int) -> list[float]:
    """alpha_1..alpha_k of a chain from an export's cumulative top-k table (its top-1 column per depth), the last
    depth's rate repeated past the table; [] without a table."""
    if not table:
        return []
    rates = [float(row[0]) for row in table]
    return [rates[min(i, len(rates) - 1)] for i in range(k)]


def expected_tokens(alpha: Sequence[float]) -> float:
    """E(K) = 1 + sum_k prod_{j<=k} alpha_j: tokens one step emits for a request, the bonus token counted."""
    total, path = 1.0, 1.0
    for a in alpha:
        path *= a
        total += path
    return total


@dataclass(frozen=True)
class Prediction:
    """The batch cost model's answer on a sweep's batch sizes and K."""

    speedup: dict[int, dict[int, float]]  # batch size -> K -> predicted speedup over plain
    best_k: dict[int, int]  # batch size -> the K predicted best (0: no drafting)
    crossover: int | None  # the first batch size where no K pays (None: every one pays)
    verify_ms: dict[str, float]  # "B,w" -> ms
    expected_tokens: dict[int, float]  # K -> E(K)
    alpha: list[float]
    draft_ms: dict[int, float]  # K -> d(1, K)
    smoothed_ms: dict[str, float]  # "B,w" -> ms as the model read them (`smooth`)

    def record(self) -> dict[str, Any]:
        return {"speedup": {str(b): {str(k): s for k, s in row.items()} for b, row in self.speedup.items()},
                "best_k": {str(b): k for b, k in self.best_k.items()}, "crossover": self.crossover,
                "verify_ms": self.verify_ms, "expected_tokens": {str(k): e for k, e in self.expected_tokens.items()},
                "alpha": self.alpha, "draft_ms_batch1": {str(k): d for k, d in self.draft_ms.items()},
                "verify_ms_smoothed": self.smoothed_ms}


def predict(costs: dict[tuple[int, int], float], batches: Sequence[int], ks: Sequence[int],
            table: Sequence[Sequence[float]] | None, draft_ms: dict[int, float] | None = None) -> Prediction:
    """speedup(B, K) for every batch size and K from the measured verify costs (read non-decreasing: `smooth`), the
    acceptance table and the batch-1 draft cost per K (`draft_ms`, else 0)."""
    draft_ms = dict(draft_ms or {})
    measured, costs = costs, smooth(costs)
    alpha = chain_alpha(table, max(ks))
    expected = {k: expected_tokens(alpha[:k]) for k in ks}
    speedup: dict[int, dict[int, float]] = {}
    best: dict[int, int] = {}
    base = costs[(min(batches), 1)]
    for b in batches:
        step = costs[(b, 1)]
        row = {k: expected[k] * step / (costs[(b, k + 1)] + draft_ms.get(k, 0.0) * step / base) for k in ks}
        speedup[b] = row
        k_best = max(row, key=lambda k: row[k])
        best[b] = k_best if row[k_best] > 1.0 else 0
    crossover = next((b for b in batches if best[b] == 0), None)
    return Prediction(speedup, best, crossover, {f"{b},{w}": ms for (b, w), ms in measured.items()}, expected,
                      alpha, draft_ms, {f"{b},{w}": ms for (b, w), ms in costs.items()})


def draft_ms_per_k(sizes: Sequence[int] | None, curve: Sequence[float] | None, ks: Sequence[int]) -> dict[int, float]:
    """d(1, K): a drafter's batch-1 draft curve (ms at node counts n = drafts + 1, eval.planner.cost) read at n = K + 1,
    interpolated; {} without one."""
    if not sizes or not curve:
        return {}
    from eval.planner.cost import interpolate

    return {k: interpolate(list(sizes), list(curve), k + 1) for k in ks}

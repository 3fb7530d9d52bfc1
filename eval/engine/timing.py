"""Timing on a shared machine, for the planner (eval.planner.cost) and for what each drafter says its drafting costs
(eval.engine.protocol.CostProbe): interleaved rounds, the least kept, and an empty verifier cache to time against."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from eval.engine.decode import VerifierSession
from models.verifiers.core import Verifier


def timed(fn, reps: int) -> float:
    return interleaved([fn], reps)[0]


def interleaved(fns: Sequence[Callable[[], Any]], reps: int) -> list[float]:
    """ms of each of `fns`: all warmed once, then timed in `reps` rounds, each round calling every fn once, and the
    least of the rounds kept (what the machine does when nothing else runs). Interleaving makes the sizes of a curve
    comparable on a shared machine: a burst of load lands on every size alike instead of on a few."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e3 for b in best]


def prefix_cache(verifier: Verifier, prefix_ids: Tensor, engine: str = "auto") -> Any:
    """An empty verifier cache through the decode loops' path (eval.engine.decode), room for the prefix
    `prefix_ids` (1, P) and one more token: what a drafter's `draft_cost` feeds the prefix through to get M_q's
    features."""
    return VerifierSession(verifier, engine, prefix_ids.shape[1] + 1, 1, 1)

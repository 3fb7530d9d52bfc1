"""Timing on a shared machine, for the planner (eval.planner.cost) and for what each drafter says its drafting costs
(eval.engine.protocol.CostProbe): interleaved rounds, the least kept, and an empty verifier cache to time against."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from eval.engine.session import VerifierSession
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


class RoundOverhead:
    """What a speculative round costs beyond its prediction, for the prediction (eval.planner.adaptive, the hybrid).

    The cost curve prices a round as the verifier's forward over its nodes plus the drafting, and the plain step as the
    forward over one token: the acceptance, the commit of the accepted positions and the Python around a round are
    not in it, and they cost a round more than they cost a plain step, so a prediction in the curve's ms
    over-promised (EAGLE-3 on the eval split: 2.5 ms a round beyond a predicted 40, docs/results/planner.md). Here
    each round is timed (from `start`, its proposal, to `stop`, the drafter told what was accepted) against its
    prediction scaled to the prompt's pace (`pace`: the plain step the runner measured on this prompt just before,
    over the curve's step; a long prompt slows both alike). Each prompt's mean excess a round is kept, and every
    later round's prediction adds the median of the finished prompts' (in the curve's ms): one prompt whose plain
    decoding or rounds something else on the machine slowed moves it little, where a mean over rounds was dragged by
    tens of ms. A decode's first round is not timed (the drafter takes in the whole prompt then). Before a prompt is
    finished, or without a measured plain step (serving, a decode run alone), nothing is added: the curves' own."""

    def __init__(self) -> None:
        self.pace: float | None = None
        self._prompt = [0.0, 0]  # this prompt's excess ms and timed rounds
        self._finished: list[float] = []  # each finished prompt's mean excess a round (ms)
        self._median = 0.0
        self._start: float | None = None
        self._predicted = 0.0

    def plain_step(self, measured_ms: float, curve_ms: float) -> None:
        """The plain step measured on the coming prompt (ms), beside the curve's: the last prompt is finished."""
        excess, rounds = self._prompt
        if rounds:
            self._finished.append(excess / rounds)
            self._median = statistics.median(self._finished)
        self._prompt = [0.0, 0]
        self.pace = measured_ms / curve_ms if measured_ms > 0 and curve_ms > 0 else None

    def per_round(self) -> float:
        """The ms (the curve's) a round costs beyond its prediction, as the finished prompts measured it."""
        return self._median / self.pace if self.pace is not None else 0.0

    def start(self, predicted_ms: float, at: float, timed: bool = True) -> None:
        """A round proposed from `at` (time.perf_counter), predicted at `predicted_ms` (the curve's, overhead
        excluded); `timed` False: not evidence (a decode's first round)."""
        self._start = at if timed and self.pace is not None else None
        self._predicted = predicted_ms

    def stop(self) -> None:
        """The round is over: its measured ms against the prediction at the prompt's pace."""
        if self._start is None or self.pace is None:
            return
        self._prompt[0] += 1e3 * (time.perf_counter() - self._start) - self.pace * self._predicted
        self._prompt[1] += 1
        self._start = None

"""A closed-loop load generator for an OpenAI-compatible server: `concurrency` clients, each sending its next prompt
when its answer is complete, until the prompts run out (what GuideLLM calls a concurrent sweep point).

Prompts go as token ids (/v1/completions accepts them), greedy unless told otherwise, streamed: the first chunk
carrying a token gives the time to first token; `return_token_ids` gives back the tokens themselves, so answers can
be compared with another decoder's token for token. httpx only (already a dependency of wandb and datasets).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Answer:
    """One request as the client saw it: the tokens, when it was sent, its first token came and it ended."""

    prompt: int  # index into the pass's prompts
    tokens: list[int]
    sent: float
    first: float | None
    done: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / (self.done - self.sent) if self.done > self.sent else 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


@dataclass
class Pass:
    """A pass over every prompt at one concurrency: the answers in prompt order, and its wall time."""

    concurrency: int
    answers: list[Answer]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(a.tokens) for a in self.answers)

    @property
    def outputs(self) -> list[list[int]]:
        return [a.tokens for a in self.answers]

    def summary(self) -> dict[str, Any]:
        """Output tokens/s over the pass; per-request tokens/s and time to first token (median and p90)."""
        rates = [a.tokens_per_s for a in self.answers]
        ttfts = [t for t in (a.ttft for a in self.answers) if t is not None]
        return {"tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0, "tokens": self.tokens,
                "seconds": self.seconds, "requests": len(self.answers),
                "per_request_tokens_per_s": {"median": percentile(rates, 50), "p90": percentile(rates, 90)},
                "ttft_s": {"median": percentile(ttfts, 50), "p90": percentile(ttfts, 90)}}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linearly interpolated (None for no values)."""
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]) if 0 < q < 100 else (
        float(min(values)) if q <= 0 else float(max(values)))


async def _complete(client: Any, url: str, body: dict[str, Any], index: int) -> Answer:
    sent, first = time.perf_counter(), None
    tokens: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"{url} answered {response.status_code}: {text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # the engine failed mid-stream (vLLM sends the error as an event)
                raise RuntimeError(f"{url} failed the request mid-stream: {chunk['error']}")
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter()
                tokens += ids
    return Answer(index, tokens, sent, first, time.perf_counter())


async def _run(url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int,
               temperature: float, seed: int) -> Pass:
    import httpx

    queue = list(range(len(prompts)))[::-1]
    answers: list[Answer] = []

    async def client_loop(client: Any) -> None:
        while queue:
            i = queue.pop()
            body = {"model": model, "prompt": list(map(int, prompts[i])), "max_tokens": int(max_tokens),
                    "temperature": float(temperature), "seed": int(seed), "stream": True,
                    "return_token_ids": True}
            answers.append(await _complete(client, url, body, i))

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return Pass(concurrency, sorted(answers, key=lambda a: a.prompt), seconds)


def run_pass(url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int,
             temperature: float = 0.0, seed: int = 0) -> Pass:
    """Every prompt through the server at `url` with `concurrency` clients in a closed loop."""
    return asyncio.run(_run(url, model, prompts, max_tokens, concurrency, temperature, seed))

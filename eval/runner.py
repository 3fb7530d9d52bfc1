"""Decoding the prompts: one `Runner` that times every method on a prompt (our plain decoding, each drafter, the
Hugging Face references), `run_prompts` over conversations (multi-turn included), and the sampling settings. The
single-family run and `method=all` both decode through it (eval.harness builds what it decodes with).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm
from transformers import GenerationConfig

from data.chat import prompt_ids
from data.prompts import Conversation
from eval.drafters import online
from eval.engine.acceptance import rule_for
from eval.engine.decode import DecodeResult, sample_decode, speculative_decode
from eval.engine.protocol import Assistant, CategoryPriced, Drafter, Paced
from eval.engine.sampling import SamplingConfig
from eval.engine.session import prepare
from eval.report import SPECULATIVE, Sample
from models.verifiers.core import Verifier
from runtime.errors import UserError


def check_length(verifier: Verifier, ids: list[int], max_new_tokens: int, where: str) -> None:
    """Refuse a prompt that does not leave room for max_new_tokens in the verifier's context window."""
    window = getattr(verifier.config, "max_position_embeddings", None)
    if window is not None and max_new_tokens >= window:
        raise UserError(f"max_new_tokens={max_new_tokens} does not fit the verifier's context window of {window} "
                        f"tokens, prompt included; lower max_new_tokens well below {window}.")
    if window is not None and len(ids) > window - max_new_tokens:
        raise UserError(
            f"{where} is {len(ids)} tokens after the chat template; with max_new_tokens={max_new_tokens} the "
            f"verifier's context window of {window} allows at most {window - max_new_tokens}. Shorten or drop that "
            f"prompt, or lower max_new_tokens."
        )


def assistant_of(drafter: Drafter) -> tuple[Any | None, int]:
    """The model HF assisted generation can use as `assistant_model` and its drafts per round, for a drafter that
    offers one (eval.engine.protocol.Assistant: a draft model), or (None, 0)."""
    return drafter.hf_assistant() if isinstance(drafter, Assistant) else (None, 0)


class Runner:
    """Decodes one prompt with every method and times each (wall clock around the whole call, so that our loops and
    HF's are measured the same way): our plain decoding (`baseline`), each drafter, then the HF references. One
    path for one drafter (`drafters` a Drafter: method `speculative`) and for many (`method=all`: a dict, method
    label -> drafter), so greedy or sampled, the engine and every option mean the same in both. With `assistant`
    (a draft model), HF assisted generation joins the references, proposing a constant `assistant_tokens` per
    round."""

    def __init__(self, verifier: Verifier, drafters: Drafter | Mapping[str, Drafter], max_new_tokens: int,
                 lookup: int, sampling: SamplingConfig | None = None, seed: int = 0, engine: str = "auto",
                 assistant: Any | None = None, assistant_tokens: int = 4) -> None:
        self.drafters = dict(drafters) if isinstance(drafters, Mapping) else {SPECULATIVE: drafters}
        self.verifier, self.max_new, self.engine = verifier, max_new_tokens, engine
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.generator = torch.Generator(verifier.device).manual_seed(seed)
        gen_eos = verifier.model.generation_config.eos_token_id
        eos = {verifier.tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos = sorted(e for e in eos if e is not None)
        # Every field that could change greedy output is set here, so the checkpoint's generation_config.json
        # (which fills unset fields) cannot leak a repetition penalty or a sampling default into the reference.
        s = self.sampling
        sample = dict(do_sample=False) if s is None else dict(do_sample=True, temperature=s.temperature,
                                                              top_p=s.top_p, top_k=s.top_k)
        common = dict(
            max_new_tokens=max_new_tokens, **sample, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
            min_new_tokens=0, eos_token_id=self.eos, pad_token_id=verifier.tokenizer.pad_token_id, use_cache=True,
        )
        self.hf_config = GenerationConfig(**common)
        self.lookup_config = GenerationConfig(**common, prompt_lookup_num_tokens=lookup)
        self.assistant = assistant
        if assistant is not None:
            # A constant number of drafts (HF's default schedule adapts it) and no early stop on confidence: the
            # chain our draft-model drafter proposes. HF reads these from the assistant's own generation_config
            # (set on the config passed to generate, they are silently ignored).
            assistant.generation_config.update(num_assistant_tokens=assistant_tokens,
                                               num_assistant_tokens_schedule="constant",
                                               assistant_confidence_threshold=0.0)

    def _sync(self) -> None:
        if self.verifier.device.type == "cuda":
            torch.cuda.synchronize()

    def _hf(self, ids: Tensor, config: GenerationConfig) -> list[int]:
        out = self.verifier.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, ids.shape[1]:].tolist()

    def _assisted(self, ids: Tensor) -> list[int]:
        out = self.verifier.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=self.assistant,
                                           generation_config=self.hf_config)
        return out[0, ids.shape[1]:].tolist()

    def decode(self, ids: list[int], prompt_id: str = "", category: str = "", turn: int = 0) -> Sample:
        """Every method on one prompt, in a fixed interleaved order."""
        x = torch.tensor([ids], device=self.verifier.device)  # (1, T)
        seconds, outputs, results = {}, {}, {}
        prepare(self.verifier, len(ids) + self.max_new, self.engine)  # untimed: the first loop would pay it alone
        for drafter in self.drafters.values():
            if isinstance(drafter, CategoryPriced):
                drafter.prompt_category(category)
        v, n, s, g, e = self.verifier, self.max_new, self.sampling, self.generator, self.engine
        calls: dict[str, Callable[[], Any]] = {"baseline": lambda: sample_decode(v, x, n, self.eos, s, g, engine=e)}
        for name, drafter in self.drafters.items():
            calls[name] = lambda d=drafter: speculative_decode(v, d, x, n, self.eos, s, g, engine=e)
        calls["hf_generate"] = lambda: self._hf(x, self.hf_config)
        calls["hf_prompt_lookup"] = lambda: self._hf(x, self.lookup_config)
        if self.assistant is not None:
            calls["hf_assisted"] = lambda: self._assisted(x)
        for method, call in calls.items():
            self._sync()
            start = time.perf_counter()
            out = call()
            self._sync()
            seconds[method] = time.perf_counter() - start
            if isinstance(out, DecodeResult):
                results[method], outputs[method] = out, out.tokens[0].tolist()
            else:
                outputs[method] = out
            if method == "baseline":  # the plain step on this prompt: the pace of the drafters' predictions
                steps = max(out.num_forwards - 1, 1)
                for drafter in self.drafters.values():
                    if isinstance(drafter, Paced):
                        drafter.plain_step(1e3 * (seconds[method] - out.times.get("prefill_s", 0.0)) / steps)
        predicted = {}  # what a planned drafter predicted for its rounds of this prompt, each before it ran
        for name, drafter in self.drafters.items():
            if isinstance(drafter, Paced) and (p := drafter.prediction()) is not None:
                # The rounds' prediction, and the prompt's prefill as this decode timed it before its first round:
                # the same verifier forward plain decoding runs, on both sides of the speedup the report predicts.
                predicted[name] = asdict(p) | {"prefill_ms": 1000 * results[name].times.get("prefill_s", 0.0)}
        return Sample(
            id=prompt_id, category=category, turn=turn, prompt_tokens=len(ids), seconds=seconds, outputs=outputs,
            lengths={m: r.accept_lengths[:, 0].cpu() for m, r in results.items() if m != "baseline"},
            forwards={m: r.num_forwards for m, r in results.items()}, times={m: r.times for m, r in results.items()},
            predicted=predicted,
        )


def user_turns(conv: Conversation) -> list[list[dict[str, str]]]:
    """The history before each user turn's answer: system and user messages so far, the source's own assistant
    turns left out (the verifier's answers replace them as they are decoded)."""
    history, out = [], []
    for message in conv.messages:
        if message["role"] != "assistant":
            history.append(message)
            if message["role"] == "user":
                out.append(list(history))
    return out


def run_prompts(
    runner: Runner, convs: Sequence[Conversation], multi_turn: bool, warmup: bool = True, progress: bool = True
) -> list[Sample]:
    """Decode every conversation's first user turn (or, with multi_turn, every turn with the verifier's own greedy
    answers as history, each turn a separate measured decode)."""
    tok, samples = runner.verifier.tokenizer, []
    rendering = runner.verifier.rendering  # chat through the template, or plain text a base model continues
    first = [prompt_ids(tok, user_turns(c)[0], rendering) for c in convs]
    for conv, ids in zip(convs, first):  # fail before minutes of decoding, not in the middle
        check_length(runner.verifier, ids, runner.max_new, f"prompt {conv.id!r}")
    if warmup and first:
        # Uncounted: the first calls pay for lazy initialisation (kernels, allocator, HF's generation setup).
        with online.frozen():  # and no drafter learning while it decodes (drafter.adapt) learns the prompt first
            runner.decode(first[0])
    total = sum(len(user_turns(c)) if multi_turn else 1 for c in convs)
    with tqdm(total=total, desc="eval", unit="prompt", disable=not progress) as bar:
        for conv in convs:
            answers: list[dict[str, str]] = []  # the verifier's own answers so far, one per earlier turn
            for turn, history in enumerate(user_turns(conv)[: None if multi_turn else 1], start=1):
                messages = _interleave(history, answers)
                ids = prompt_ids(tok, messages, rendering)
                check_length(runner.verifier, ids, runner.max_new, f"prompt {conv.id!r}, turn {turn}")
                sample = runner.decode(ids, conv.id, conv.category, turn)
                samples.append(sample)
                bar.update(1)
                answer = tok.decode(sample.outputs["baseline"], skip_special_tokens=True)
                answers.append({"role": "assistant", "content": answer})
    return samples


def _interleave(history: list[dict[str, str]], answers: list[dict[str, str]]) -> list[dict[str, str]]:
    """Put answer i right after the i-th user message of `history`."""
    out, i = [], 0
    for message in history:
        out.append(message)
        if message["role"] == "user" and i < len(answers):
            out.append(answers[i])
            i += 1
    return out


def sampling_record(s: SamplingConfig, sampled_drafts: bool = False) -> dict[str, Any]:
    """report.json's `sampling`: the settings and whether the speculative output keeps the verifier's distribution
    (`exact`); typical acceptance is marked lossy."""
    rule = rule_for(s)
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "rule": rule.name, "verify": s.verify,
            "exact": rule.exact, "lossy": not rule.exact,
            "sampled_drafts": sampled_drafts and not s.greedy}

"""Self-generated prompts (Magpie, Xu et al. 2024): the verifier writes the user turns itself.

The chat template is rendered up to the point where a user message would start (for SmolLM2: the system prompt,
then `<|im_start|>user\\n`), and the verifier samples from there until its end-of-turn token: what comes out is a
user request drawn from the verifier's own idea of what users ask. No download, no licence, and the prompts follow
the distribution the drafter will be used on. Optional seed topics steer diversity by naming a topic in the system
prompt (one topic per prompt, round-robin).

Generation runs in shards (JSONL, each written atomically) so a killed run resumes; the raw prompts are then
filtered (`data.filters`: length, repetition, language, near-duplicates), with the counts printed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from data.filters import QualityFilter, apply_filters
from data.generate import generate_refill
from data.prompts import Conversation
from models.verifiers.core import Verifier
from runtime.errors import UserError

SENTINEL = "@@SPECDRAFT_USER_TURN@@"
TOPICS = ["cooking", "travel", "personal finance", "health and fitness", "history", "physics", "biology", "chemistry",
          "mathematics", "programming in Python", "web development", "creative writing", "poetry", "business strategy",
          "marketing", "career advice", "relationships", "education", "philosophy", "music", "movies and books",
          "gardening", "home repair", "law", "psychology", "economics", "geography", "sports", "pets", "technology",
          "environment", "language learning"]


def user_header(tokenizer: PreTrainedTokenizerBase, system: str | None = None) -> tuple[list[int], list[int]]:
    """(prefix ids, end-of-turn ids): the template rendered up to where a user message starts, found by rendering a
    conversation whose user message is a sentinel and cutting at it; and the first token after the sentinel (the
    end of the user turn), which stops sampling."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    if tokenizer.chat_template is None:
        raise UserError(f"data.source=selfgen needs a chat template; {tokenizer.name_or_path!r} has none. Use an "
                        f"instruct/chat verifier.")
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    cut = text.find(SENTINEL)
    if cut < 0:
        raise UserError(f"the chat template of {tokenizer.name_or_path!r} does not show the user message verbatim, so "
                        f"the user header cannot be found. Use data.source=<prompt file> instead.")
    prefix = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
    after = tokenizer(text[cut + len(SENTINEL):], add_special_tokens=False)["input_ids"]
    stops = sorted({tokenizer.eos_token_id, *after[:1]} - {None})
    return prefix, stops


def steer(topic: str | None) -> str | None:
    return None if topic is None else f"You are a helpful AI assistant. The user asks you about {topic}."


def generate_prompts(verifier: Verifier, num: int, temperature: float = 1.0, top_p: float = 0.95,
                     max_new_tokens: int = 96, batch_size: int = 32, seed: int = 0,
                     topics: list[str] | None = None, on_done=None) -> list[dict[str, str]]:
    """`num` raw user turns sampled from the verifier: [{"prompt", "category"}], unfiltered."""
    tok = verifier.tokenizer
    assignment = [(topics[i % len(topics)] if topics else None) for i in range(num)]
    headers = {t: user_header(tok, steer(t)) for t in set(assignment)}
    stops = sorted({s for _, st in headers.values() for s in st})
    # one refill run over every sample: the topic prefixes differ, the engine takes prompts of any length
    answers = generate_refill(verifier, [headers[t][0] for t in assignment], max_new_tokens, temperature, top_p,
                              batch_size, seed, stop_ids=stops, on_done=on_done)
    texts = []
    for a in answers:
        ended = bool(a) and a[-1] in stops
        # an unfinished turn (hit max_new_tokens) is marked so it can be dropped
        text = tok.decode(a[:-1] if ended else a, skip_special_tokens=True).strip()
        texts.append(text + ("" if ended else " \u2026"))
    return [{"prompt": t, "category": f"selfgen/{a or 'any'}"} for t, a in zip(texts, assignment)]


def selfgen_conversations(verifier: Verifier, cache_dir: str | Path, num: int = 1000, temperature: float = 1.0,
                          top_p: float = 0.95, max_new_tokens: int = 96, batch_size: int = 32, seed: int = 0,
                          topics: list[str] | str | None = None, shard_size: int = 512,
                          quality: dict[str, Any] | None = None, dedup_threshold: float | None = 0.7,
                          unfinished: bool = False) -> list[Conversation]:
    """Self-generated, filtered prompts as Conversations (cached in shards under `<cache>/selfgen/<key>/`).

    Args:
        topics: None (pure Magpie), `builtin` (the TOPICS list here), or a list of topic strings.
        quality: keyword arguments of `data.filters.QualityFilter`.
        unfinished: keep turns cut by max_new_tokens (dropped by default).
    """
    if topics == "builtin":
        topics = TOPICS
    if isinstance(topics, str):
        raise UserError(f"data.selfgen.topics={topics!r}: give null, `builtin`, or a list of topics.")
    topics = list(topics) if topics else None
    settings = {"verifier": verifier.fingerprint, "template": verifier.tokenizer.chat_template, "T": temperature,
                "top_p": top_p, "max_new_tokens": max_new_tokens, "batch_size": batch_size, "seed": seed,
                "topics": topics, "shard_size": shard_size}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() / "selfgen" / key
    root.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, str]] = []
    starts = list(range(0, num, shard_size))
    have = [s for s in starts if (root / f"{s // shard_size:05d}-{min(shard_size, num - s)}.jsonl").is_file()]
    bar = tqdm(total=num, initial=sum(min(shard_size, num - s) for s in have), desc="self-generated prompts",
               unit="prompt", dynamic_ncols=True)
    for s in starts:
        n = min(shard_size, num - s)
        path = root / f"{s // shard_size:05d}-{n}.jsonl"
        if not path.is_file():
            shard_topics = [topics[(s + i) % len(topics)] for i in range(len(topics))] if topics else None
            recs = generate_prompts(verifier, n, temperature, top_p, max_new_tokens, batch_size,
                                    seed + s // shard_size, shard_topics, on_done=lambda *_: bar.update(1))
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
            os.replace(tmp, path)  # a shard is there whole or not at all
        records += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    bar.close()
    texts = [r["prompt"] for r in records]
    quality_filter = QualityFilter(**(quality or {}))
    if not unfinished:
        cut = sum(t.endswith("\u2026") for t in texts)
        print(f"[data] selfgen: {cut} of {len(texts)} turns did not end within {max_new_tokens} tokens (dropped)")
        keep_idx = [i for i, t in enumerate(texts) if not t.endswith("\u2026")]
    else:
        keep_idx = list(range(len(texts)))
    kept = apply_filters([texts[i] for i in keep_idx], quality_filter, None, dedup_threshold, "selfgen")
    return [Conversation(f"selfgen-{keep_idx[j]}", records[keep_idx[j]]["category"],
                         [{"role": "user", "content": texts[keep_idx[j]]}]) for j in kept]

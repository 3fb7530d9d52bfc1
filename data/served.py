"""A served record (serve/record.py: what `python -m serve EXPORT --record DIR` kept of the requests it served) as the
trainer's rows: `python train.py data=served data.source=DIR` reads it as it is. input_ids = prompt ids + answer ids,
loss 1 on the answer ids only: the columns of a shipped set (data/shipped.py), so the two mix (a replay sample of the
shipped set beside the record). Answers that did not end by a stop or the length limit (aborted, cut by an error) are
skipped and counted.

`served_conversations` gives the record's chat requests back as conversations, for the trainer to have the verifier
answer them again, sampled (`data.regenerate=N`, data/datamodule.py): more of the serving domain's answers than the
server wrote, each the verifier's own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import datasets

from data.prompts import Conversation
from data.selfdistill import FEATURES
from models.verifiers.core import Verifier
from runtime.errors import UserError
from serve.record import RECORDS, read_record

FINISHED = ("stop", "length")  # an answer the verifier ended itself, or the request's token limit ended


def load_served(where: str | Path, verifier: Verifier, max_length: int = 1024,
                prompt_loss: bool = False) -> datasets.Dataset:
    """The served record at `where` as rows of FEATURES plus `source` (a shipped set's columns): one row per finished
    choice, input_ids = prompt ids + answer ids (cut at `max_length`), loss 1 on the answer ids only, or with
    `prompt_loss` on the prompt's tokens too (from its second: the drafter learns the verifier's next-token
    distribution over the text users send, the serving domain's own, not only over the answers to it)."""
    folder, records, damaged = read_record(where, verifier)
    rows: dict[str, list[Any]] = {"id": [], "category": [], "input_ids": [], "loss_mask": [], "source": []}
    skipped: dict[str, int] = {}
    for n, record in enumerate(records):
        for choice in record["choices"]:
            prompt, answer, reason = choice.get("prompt_ids"), choice.get("answer_ids"), choice.get("finish_reason")
            if reason not in FINISHED or not prompt or not answer:
                key = str(reason) if reason not in FINISHED else "no tokens"
                skipped[key] = skipped.get(key, 0) + 1
                continue
            ids = (list(prompt) + list(answer))[:max_length]
            mask = ([0] + [int(prompt_loss)] * (len(prompt) - 1) + [1] * len(answer))[:max_length]
            rows["id"].append(f"{record.get('id') or n}-{choice.get('index', 0)}")
            rows["category"].append("chat" if "messages" in record else "completion")
            rows["source"].append(f"served:{folder.name}")
            rows["input_ids"].append(ids)
            rows["loss_mask"].append(mask)
    notes = [f"{c} {why}" for why, c in sorted(skipped.items())] + ([f"{damaged} unreadable lines"] if damaged else [])
    print(f"[data] served record {folder}: {len(rows['id'])} answers"
          + (f"; skipped {', '.join(notes)}" if notes else ""), flush=True)
    if not rows["id"]:
        raise UserError(f"served record {folder} holds no finished answer ({len(records)} requests recorded"
                        f"{'; skipped ' + ', '.join(notes) if notes else ''}): serve with --record {folder} and send "
                        f"requests first.")
    features = datasets.Features({**FEATURES, "source": datasets.Value("string")})
    salt = f"{max_length}{int(prompt_loss)}".encode()
    digest = hashlib.sha256((folder / RECORDS).read_bytes() + salt).hexdigest()[:16]
    # A fingerprint from the records' bytes: the same record gives the same hidden-state cache key on every run.
    return datasets.Dataset(datasets.Dataset.from_dict(rows, features=features).data.table,
                            fingerprint=f"served-{digest}")


def served_conversations(where: str | Path, verifier: Verifier) -> list[Conversation]:
    """The record's chat requests (those with at least one finished answer) as conversations, in the order served: the
    messages as the client sent them. Self-distillation answers a conversation's system message and first user turn
    (data.selfdistill.first_turn): for a one-turn request that is the recorded prompt, ids for ids; a longer one is
    answered at its first turn. Completion requests (raw text prompts) have no messages and are left out."""
    folder, records, _ = read_record(where, verifier)
    out = []
    for n, record in enumerate(records):
        messages = record.get("messages")
        finished = any(c.get("finish_reason") in FINISHED and c.get("answer_ids") for c in record["choices"])
        if isinstance(messages, list) and messages and finished:
            out.append(Conversation(id=f"served-{record.get('id') or n}", category="served", messages=messages))
    return out

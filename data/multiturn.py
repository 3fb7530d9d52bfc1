"""Second turns for self-distilled conversations: the verifier writes a follow-up user turn after its own answer
(Magpie, continued: the chat template opened where the next user message starts), then answers it.

A row [prompt, a1] gives a new row [prompt, a1, user turn 2, a2], its loss mask on a1 and a2 only. The ids are extended,
never re-rendered from text: the verifier's answer a1 stays the token ids it generated (text re-tokenised can come
out different), and what the template puts between a1's end-of-turn token and a2 is rendered once and appended
(`continuation_ids`), so the row is exactly what the verifier sees in a two-turn chat.

A template that rewrites earlier turns (Qwen3-style reasoning templates drop a1's `<think>` block once turn 2
exists, data.chat.rewrites_earlier_turns) is rendered instead: the context of a2 is the template's rendering of
[prompt messages, a1's text, user turn 2], as the verifier sees it in that chat, and the mask covers a2 only (a1 is
trained in its own single-turn row, where it reads as generated).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from data.chat import control_tokens, encode_rendered, render, rewrites_earlier_turns
from data.filters import EvalGuard, QualityFilter, apply_filters
from data.generate import generate_refill
from models.verifiers.core import Verifier
from runtime.errors import UserError
from runtime.io import atomic_dir

SENT_A, SENT_U = "@@SPECDRAFT_ANSWER@@", "@@SPECDRAFT_USER_TURN@@"


def _render(tokenizer: PreTrainedTokenizerBase, user: str) -> tuple[str, int, int]:
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENT_A},
            {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    eot = tokenizer.decode([tokenizer.eos_token_id])
    start = text.find(SENT_A + eot)
    if start < 0:
        raise UserError(f"the chat template of {tokenizer.name_or_path!r} does not end an assistant turn with its EOS "
                        f"token ({eot!r}), so a second turn cannot be appended to the verifier's own answer ids. Use "
                        f"single-turn data (ship.second_turns=0).")
    return text, start + len(SENT_A) + len(eot), text.find(SENT_U)


def continuation_ids(tokenizer: PreTrainedTokenizerBase, user: str) -> list[int]:
    """The ids the template puts after an assistant turn's end-of-turn token: the next user turn with `user`, then
    the assistant's header (where the verifier starts answering)."""
    text, cut, _ = _render(tokenizer, user)
    probe, _, at = _render(tokenizer, SENT_U)  # where the user text lies: control tokens in it stay text (data.chat)
    if probe.replace(SENT_U, user) != text:  # the template changes the text: it may not hold a control token
        held = [t for t in control_tokens(tokenizer) if t in user]
        if held:
            raise UserError(f"a second user turn {user[:60]!r} holds the control token {held[0]!r}, and the chat "
                            f"template of {tokenizer.name_or_path!r} does not show it verbatim, so it cannot be kept "
                            f"as text. Use single-turn data (ship.second_turns=0).")
        return tokenizer(text[cut:], add_special_tokens=False)["input_ids"]
    return encode_rendered(tokenizer, text[cut:], [(at - cut, at - cut + len(user))])


def user_opener_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids after an assistant turn's end-of-turn token up to where the next user message starts."""
    text, cut, user = _render(tokenizer, SENT_U)
    return tokenizer(text[cut:user], add_special_tokens=False)["input_ids"]


def second_turn_rows(verifier: Verifier, ds: datasets.Dataset, num: int, cache_dir: str | Path, seed: int = 0,
                     max_length: int = 1024, max_new_tokens: int = 384, user_tokens: int = 96,
                     batch_size: int = 64, guard: EvalGuard | None = None,
                     quality: dict[str, Any] | None = None,
                     messages: dict[str, list[dict[str, str]]] | None = None) -> datasets.Dataset:
    """Two-turn rows made from `num` rows of `ds` (drawn with `seed` among those whose answer ended and that leave
    room for a second turn): each extended by a follow-up user turn sampled from the verifier (T=1, top-p 0.95, at
    most `user_tokens`; unfinished, low-quality, near-duplicate or eval-matching turns are dropped) and the
    verifier's greedy answer to it. Returns the new rows only (id and source marked `+turn2`), to append: the
    single-turn rows stay, so a set that gains them keeps its earlier rows as they were. Each stage is cached
    under `<cache>/second-turns/<key>/`, so a rerun after a kill redoes at most the stage it was in. `messages`
    (row id -> the prompt's chat messages) is needed for templates that rewrite earlier turns (see above)."""
    tok = verifier.tokenizer
    eos = tok.eos_token_id
    room = max_length - user_tokens - 64
    rows = [j for j, (ids, mask) in enumerate(zip(ds["input_ids"], ds["loss_mask"])) if ids[-1] == eos and mask[-1]
            and len(ids) < room]
    picked = sorted(random.Random(seed).sample(rows, min(num, len(rows))))
    settings = {"verifier": verifier.fingerprint, "data": ds._fingerprint, "rows": picked, "seed": seed,
                "max_length": max_length, "max_new_tokens": max_new_tokens, "user_tokens": user_tokens,
                "template": tok.chat_template}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() / "second-turns" / key
    opener = user_opener_ids(tok)
    text, _, user = _render(tok, SENT_U)
    stops = sorted({eos, *tok(text[user + len(SENT_U):], add_special_tokens=False)["input_ids"][:1]} - {None})

    users_file = root / "users" / "users.json"
    if not users_file.is_file():
        prefixes = [list(ds[j]["input_ids"]) + opener for j in picked]
        turns = generate_refill(verifier, prefixes, user_tokens, 1.0, 0.95, batch_size, seed, stop_ids=stops)
        with atomic_dir(users_file.parent) as tmp:
            (tmp / "users.json").write_text(json.dumps(turns))
    turns = json.loads(users_file.read_text())
    texts = [tok.decode(t[:-1] if t and t[-1] in stops else t, skip_special_tokens=True).strip()
             if t and t[-1] in stops else "" for t in turns]
    ended = [i for i, t in enumerate(texts) if t]
    print(f"[data] second turns: {len(picked) - len(ended)} of {len(picked)} follow-up turns did not end within "
          f"{user_tokens} tokens (those rows stay single-turn)")
    kept = [ended[i] for i in apply_filters([texts[i] for i in ended], QualityFilter(**(quality or {})), guard, 0.7,
                                            "second turns")]
    rewrites = rewrites_earlier_turns(tok)
    if rewrites:
        missing = [ds[picked[i]]["id"] for i in kept if ds[picked[i]]["id"] not in (messages or {})]
        if missing:
            raise UserError(f"the chat template of {tok.name_or_path!r} rewrites earlier turns (it drops their "
                            f"reasoning), so a second turn is rendered from the first turn's messages; none given for "
                            f"rows {missing[:3]}. Pass messages= (row id -> messages), or ship.second_turns=0.")
        prompts = []
        for i in kept:
            row = ds[picked[i]]
            first = row["loss_mask"].index(1)
            a1 = tok.decode([t for t in row["input_ids"][first:] if t != eos], skip_special_tokens=False)
            prompts.append(render(tok, [*messages[row["id"]], {"role": "assistant", "content": a1},
                                        {"role": "user", "content": texts[i]}], add_generation_prompt=True))
    else:
        prompts = [list(ds[picked[i]]["input_ids"]) + continuation_ids(tok, texts[i]) for i in kept]
    answers_file = root / "answers" / "answers.json"
    if not answers_file.is_file():
        answers = generate_refill(verifier, prompts, max_new_tokens, 0.0, 1.0, batch_size, seed)
        with atomic_dir(answers_file.parent) as tmp:
            (tmp / "answers.json").write_text(json.dumps(answers))
    answers = json.loads(answers_file.read_text())
    if len(answers) != len(kept):
        raise RuntimeError(f"{answers_file}: {len(answers)} answers for {len(kept)} turns; delete {root} and rerun")
    rows: dict[str, list] = {name: [] for name in ds.column_names}
    for i, prompt, answer in zip(kept, prompts, answers):
        row = ds[picked[i]]
        answer = answer[: answer.index(eos) + 1] if eos in answer else answer
        if rewrites:  # a1 as the template re-renders it is context here; its own row trains it as generated
            mask = [0] * len(prompt) + [1] * len(answer)
        else:
            mask = list(row["loss_mask"]) + [0] * (len(prompt) - len(row["input_ids"])) + [1] * len(answer)
        row.update(input_ids=(prompt + answer)[:max_length], loss_mask=mask[:max_length], id=f"{row['id']}+turn2")
        if "source" in row:
            row["source"] = f"{row['source']}+turn2"
        for name in rows:
            rows[name].append(row[name])
    print(f"[data] second turns: {len(rows['id'])} two-turn rows")
    return datasets.Dataset.from_dict(rows, features=ds.features)

"""Self-distillation: the verifier answers the prompts, and its own tokens become the training targets.

Drafters are trained to predict what the verifier will say, so the best data is the verifier's own output. Answers are
generated in batches (left-padded, shortest prompts together), kept as the verifier's token ids (no detokenise /
retokenise round trip), and cached as a `datasets` Arrow dataset keyed by everything that changes them: the verifier
fingerprint, the prompts, the chat template and the generation settings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import datasets
import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from data.chat import encode_conversation, prompt_ids
from data.prompts import Conversation
from models.errors import UserError
from models.io import atomic_dir
from models.verifier import Verifier

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "category": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
)


def cache_key(verifier: Verifier, convs: list[Conversation], settings: dict[str, Any]) -> str:
    """A short hash of everything the generated dataset depends on."""
    payload = {
        "verifier": verifier.fingerprint,
        "template": verifier.tokenizer.chat_template,
        "prompts": [(c.id, c.messages) for c in convs],
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def generate_answers(
    verifier: Verifier,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    desc: str = "self-distillation",
) -> list[list[int]]:
    """Answer each prompt (token ids) with the verifier; returns the answer ids, ending with EOS when it stopped."""
    tok = verifier.tokenizer
    eos = tok.eos_token_id
    pad = tok.pad_token_id
    device = verifier.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch: less padding
    answers: list[list[int]] = [[] for _ in prompts]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # An explicit config: the checkpoint's own generation defaults (top_p, repetition penalty...) must not leak in.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        input_ids = torch.full((len(idx), width), pad, dtype=torch.long)  # (B, T), left padded
        attention = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            attention[row, width - len(prompts[i]) :] = 1
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # reproducible sampling per batch
        out = verifier.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=config
        )
        for row, i in enumerate(idx):
            new = out[row, width:].tolist()
            if eos in new:
                new = new[: new.index(eos) + 1]
            answers[i] = new
        bar.update(len(idx))
    bar.close()
    return answers


def first_turn(conv: Conversation) -> list[dict[str, str]]:
    """The system message (if any) and the first user turn: what the verifier answers in self-distillation."""
    msgs = []
    for m in conv.messages:
        if m["role"] in ("system", "user"):
            msgs.append(m)
        if m["role"] == "user":
            break
    return msgs


def build_selfdistill(
    verifier: Verifier,
    convs: list[Conversation],
    cache_dir: str | Path,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    batch_size: int = 32,
    seed: int = 0,
    max_length: int = 1024,
) -> datasets.Dataset:
    """The self-distilled dataset for `convs` (first user turn of each), from the cache or generated and cached."""
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "max_length": max_length}
    key = cache_key(verifier, convs, settings)
    path = Path(cache_dir).expanduser() / "selfdistill" / key
    if (path / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(path))
    tok = verifier.tokenizer
    prompts = [prompt_ids(tok, first_turn(c)) for c in convs]
    answers = generate_answers(verifier, prompts, max_new_tokens, temperature, batch_size, seed)
    rows: dict[str, list] = {"id": [], "category": [], "input_ids": [], "loss_mask": []}
    for conv, p, a in zip(convs, prompts, answers):
        ids = (p + a)[:max_length]
        mask = ([0] * len(p) + [1] * len(a))[:max_length]
        rows["id"].append(conv.id)
        rows["category"].append(conv.category)
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
    ds = datasets.Dataset.from_dict(rows, features=FEATURES)
    with atomic_dir(path) as tmp:
        ds.save_to_disk(str(tmp))
        (tmp / "settings.json").write_text(json.dumps({"verifier": verifier.source, **settings, "num": len(convs)}))
    return datasets.load_from_disk(str(path))


def build_sharegpt(verifier: Verifier, convs: list[Conversation], max_length: int = 1024) -> datasets.Dataset:
    """Conversations as they are (no regeneration), tokenised with the verifier's template, assistant-only masks."""
    rows: dict[str, list] = {"id": [], "category": [], "input_ids": [], "loss_mask": []}
    for conv in convs:
        ids, mask = encode_conversation(verifier.tokenizer, conv.messages, max_length)
        rows["id"].append(conv.id)
        rows["category"].append(conv.category)
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
    return datasets.Dataset.from_dict(rows, features=FEATURES)


def check_has_targets(ds: datasets.Dataset, min_shift: int, source: str) -> None:
    """Refuse a dataset with nothing to learn: no assistant token at least `min_shift` positions into a sequence."""
    usable = sum(sum(m[min_shift:]) for m in ds["loss_mask"])
    if usable == 0:
        raise UserError(
            f"data from {source!r} has no assistant tokens left after masking and truncation ({len(ds)} sequences). "
            f"Raise data.max_length or data.max_new_tokens, or give conversations with assistant turns."
        )

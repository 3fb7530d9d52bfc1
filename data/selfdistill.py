"""Self-distillation: the verifier answers the prompts, and its own tokens become the training targets.

Drafters are trained to predict what the verifier will say, so the best data is the verifier's own output. Answers are
generated with refill batching (`data.generate`: a row that stops leaves, a queued prompt takes its place), kept as the
verifier's token ids (no detokenise / retokenise round trip), and cached as a `datasets` Arrow dataset keyed by
everything that changes them: the verifier fingerprint, the prompts, the chat template, the rendering and the generation
settings. A verifier that renders plain text (a base model: `Verifier.rendering`, data/chat.py) continues each prompt
as plain text; the loss mask covers that continuation, and the dataset's settings.json records the rendering.
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

from data.chat import encode_turns, prompt_ids
from data.generate import generate_refill
from data.prompts import Conversation
from models.verifiers.core import Verifier
from runtime.errors import UserError
from runtime.io import atomic_dir

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "category": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
)


GENERATORS = {"hf": "refill", "vllm": "vllm-0.32.0"}  # data.generator -> what the cache key records


def cache_key(verifier: Verifier, convs: list[Conversation], settings: dict[str, Any]) -> str:
    """A short hash of everything the generated dataset depends on."""
    payload = {
        "verifier": verifier.fingerprint,
        "template": verifier.tokenizer.chat_template,
        "prompts": [(c.id, c.messages) for c in convs],
        "settings": settings,
    }
    if verifier.rendering != "chat":  # in the key only where it is not the default: chat-rendered caches keep theirs
        payload["rendering"] = verifier.rendering
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
    """Answer each prompt (token ids) with `model.generate` in fixed batches (the baseline `scripts/bench/train.py`
    compares `generate_refill` against); returns the answer ids, ending with EOS when it stopped."""
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


def _rows(convs: list[Conversation], prompts: list[list[int]], answers: list[list[int]], max_length: int) -> dict:
    rows: dict[str, list] = {"id": [], "category": [], "input_ids": [], "loss_mask": []}
    for conv, p, a in zip(convs, prompts, answers):
        rows["id"].append(conv.id)
        rows["category"].append(conv.category)
        rows["input_ids"].append((p + a)[:max_length])
        rows["loss_mask"].append(([0] * len(p) + [1] * len(a))[:max_length])
    return rows


def build_selfdistill(
    verifier: Verifier,
    convs: list[Conversation],
    cache_dir: str | Path,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    batch_size: int = 32,
    seed: int = 0,
    max_length: int = 1024,
    shard_size: int = 256,
    top_p: float = 1.0,
    groups: list[int] | None = None,
    generator: str = "hf",
) -> datasets.Dataset:
    """The self-distilled dataset for `convs` (first user turn of each), from the cache or generated and cached.

    Generation runs in shards of at most `shard_size` prompts, in order; with `groups` (the sizes of consecutive
    source groups in `convs`, e.g. [selfgen prompts, registry prompts]) no shard straddles two groups. A shard is
    named by the hash of its own prompts and settings (`<cache>/selfdistill-shards/<shard key>/`) and saved
    atomically as soon as it is done, so a killed build resumes from its finished shards, and a build whose sources
    share whole groups with an earlier one (a source added, another's prompt count changed) reuses their shards.
    All pending shards go through one refill run, queued in order (see the loop below). Sampling (temperature > 0)
    is per prompt, seeded by `seed` and the prompt's index within its group. Once every shard is there they are joined
    into `<cache>/selfdistill/<key>`; the shards stay (token ids only: ~4 MB per 1M tokens) for later builds.

    `generator`: `hf` (this process, `generate_refill`) or `vllm` (the real vLLM's offline batched generation, one
    vLLM process per shard, serve/vllm_engine.py: what users run at scale on GPU nodes). The generator is in the
    cache key: the two write separate datasets.
    """
    if shard_size < 1:
        raise UserError(f"data.shard_size={shard_size}: give a whole number of prompts >= 1 per shard.")
    if generator not in GENERATORS:
        raise UserError(f"data.generator={generator!r} is not one of {list(GENERATORS)}.")
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "max_length": max_length,
                "engine": GENERATORS[generator], "batch_size": batch_size, "shard_size": shard_size, "top_p": top_p}
    if temperature > 0:
        settings["rng"] = "per-prompt"  # sampled answers drawn from each prompt's own stream (data.generate)
    key = cache_key(verifier, convs, settings)
    root = Path(cache_dir).expanduser()
    path = root / "selfdistill" / key
    if (path / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(path))
    groups = list(groups) if groups else [len(convs)]
    if sum(groups) != len(convs) or any(g < 0 for g in groups):
        raise ValueError(f"groups {groups} do not add up to the {len(convs)} conversations")
    tok = verifier.tokenizer
    prompts = [prompt_ids(tok, first_turn(c), verifier.rendering) for c in convs]
    # A prompt that fills max_length leaves no room for an answer token in its row: it is not answered, its row is
    # dropped (a registry prompt of 47,618 tokens, prefilled in a batch of 48, once took a build past 24 GB).
    too_long = [len(p) >= max_length for p in prompts]
    if all(too_long):
        raise UserError(f"self-distillation: all {len(convs)} prompts have max_length={max_length} tokens or more "
                        f"(shortest {min(map(len, prompts))}), so no row would have assistant tokens. Raise "
                        f"data.max_length.")
    if any(too_long):
        print(f"[data] self-distillation: {sum(too_long)} of {len(convs)} prompts have max_length={max_length} tokens "
              f"or more (longest {max(map(len, prompts))}): not answered, left out. "
              f"Raise data.max_length to keep them.")
    plan: list[tuple[int, int, Path]] = []  # (start, end, shard folder)
    offset = 0
    for size in groups:
        for index, start in enumerate(range(offset, offset + size, shard_size)):
            end = min(start + shard_size, offset + size)
            dropped = sum(too_long[start:end])  # in the key only where it changes the shard
            shard_key = cache_key(verifier, convs[start:end], settings | {"seed": seed + index}
                                  | ({"too_long_dropped": dropped} if dropped else {}))
            plan.append((start, end, root / "selfdistill-shards" / shard_key))
        offset += size
    done = [(s, e) for s, e, folder in plan if (folder / "dataset_info.json").is_file()]
    if done:
        print(f"[data] self-distillation: resuming, {len(done)} of {len(plan)} shards already in "
              f"{root / 'selfdistill-shards'}")
    bar = tqdm(total=len(convs), initial=sum(e - s for s, e in done), desc="self-distillation",
               unit="prompt", dynamic_ncols=True)
    tokens = [0]

    # One refill run over every pending shard, queued shard by shard (each shard's prompts sorted by length), so the
    # batch stays full across shard boundaries; a shard is saved the moment its last answer is in. Each prompt
    # samples from its own stream, keyed by its index within its source group, so a shard's answers do not depend
    # on which shards shared the run (a resumed build writes what an unbroken one would).
    pending = [(s, e, folder) for s, e, folder in plan if (s, e) not in done]
    order: list[int] = []  # indices into convs, in queue order
    left: dict[int, int] = {}  # shard (index into pending) -> answers still to come
    shard_of: dict[int, int] = {}
    for k, (start, end, _folder) in enumerate(pending):
        keep = sorted((i for i in range(start, end) if not too_long[i]), key=lambda i: len(prompts[i]))
        bar.update(end - start - len(keep))
        order += keep
        left[k] = len(keep)
        shard_of.update((i, k) for i in keep)
    answers: dict[int, list[int]] = {}

    def save(k: int) -> None:
        start, end, folder = pending[k]
        keep = [i for i in range(start, end) if not too_long[i]]
        with atomic_dir(folder) as tmp:
            datasets.Dataset.from_dict(_rows([convs[i] for i in keep], [prompts[i] for i in keep],
                                             [answers.pop(i) for i in keep], max_length),
                                       features=FEATURES).save_to_disk(str(tmp))

    def on_done(j: int, answer: list[int]) -> None:
        i = order[j]
        answers[i] = answer
        tokens[0] += len(answer)
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens[0] / max(1e-9, bar.format_dict['elapsed']):.0f}", refresh=False)
        left[shard_of[i]] -= 1
        if left[shard_of[i]] == 0:
            save(shard_of[i])

    for k in [k for k, n in left.items() if n == 0]:  # shards whose every prompt was too long
        save(k)
    if generator == "vllm":  # one vLLM process per shard: a killed build resumes from the shards it saved
        from serve import vllm_engine

        if not verifier.checkpoint:
            raise UserError(f"data.generator=vllm: the verifier {verifier.name} was built in memory and vLLM loads "
                            f"from a directory; use data.generator=hf, or a checkpoint verifier.")
        j = 0
        for k, n in left.items():
            if n == 0:
                continue
            rows = order[j : j + n]
            run = vllm_engine.serve(verifier.checkpoint, [prompts[i] for i in rows], max_new_tokens,
                                    dtype=str(verifier.model.dtype).removeprefix("torch."), temperature=temperature,
                                    top_p=top_p, seed=seed + k, max_model_len=max_length + max_new_tokens,
                                    warmup=False, batch=True)
            for off, answer in enumerate(run.outputs):
                on_done(j + off, stop_at(answer, verifier.tokenizer.eos_token_id))
            j += n
    else:
        generate_refill(verifier, [prompts[i] for i in order], max_new_tokens, temperature, top_p, batch_size, seed,
                        on_done=on_done, keys=[_index_in_group(i, groups) for i in order], order="given")
    bar.close()
    shards = [d for d in (datasets.load_from_disk(str(folder)) for _, _, folder in plan) if len(d)]
    ds = datasets.concatenate_datasets(shards) if len(shards) > 1 else shards[0]
    with atomic_dir(path) as tmp:
        ds.save_to_disk(str(tmp))
        (tmp / "settings.json").write_text(json.dumps({"verifier": verifier.source, **settings, "num": len(convs),
                                                       "groups": groups, "rendering": verifier.rendering}))
    return datasets.load_from_disk(str(path))


def stop_at(answer: list[int], eos: int) -> list[int]:
    """An answer cut after its first EOS, as the HF generator ends its answers (vLLM may also stop at other ids its
    generation config names, which are kept as they are)."""
    return answer[: answer.index(eos) + 1] if eos in answer else answer


def _index_in_group(i: int, groups: list[int]) -> int:
    """The index of conversation `i` within its source group."""
    offset = 0
    for size in groups:
        if i < offset + size:
            return i - offset
        offset += size
    raise ValueError(f"conversation {i} is past the groups")


def build_sharegpt(verifier: Verifier, convs: list[Conversation], max_length: int = 1024) -> datasets.Dataset:
    """Conversations as they are (no regeneration), tokenised with the verifier's template, assistant-only masks: one
    row per conversation, or one per assistant turn where the template rewrites earlier turns (data.chat)."""
    rows: dict[str, list] = {"id": [], "category": [], "input_ids": [], "loss_mask": []}
    for conv in convs:
        turns = encode_turns(verifier.tokenizer, conv.messages, max_length, where=f"conversation {conv.id!r}",
                             rendering=verifier.rendering)
        for k, (ids, mask) in enumerate(turns):  # one row, or one per assistant turn (reasoning templates)
            rows["id"].append(conv.id if len(turns) == 1 else f"{conv.id}#turn{k + 1}")
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

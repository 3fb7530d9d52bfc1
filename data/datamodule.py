"""The DataModule: prompts -> (self-distilled) token ids + assistant-only loss masks -> padded batches."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from data.chat import REASONING, TAGS, mask_reasoning
from data.filters import EvalGuard, apply_filters
from data.hidden_cache import build_argmax_cache, build_hidden_cache, cache_layers, load_argmax, load_hidden
from data.prompts import Conversation, eval_prompt_texts, load_conversations, select_prompts
from data.sampler import EpochSampler
from data.selfdistill import GENERATORS, build_selfdistill, build_sharegpt, check_has_targets
from data.selfgen import selfgen_conversations
from data.served import load_served, served_conversations
from data.shipped import fixed_order, load_shipped
from models.verifiers.core import Verifier
from runtime.distributed import world
from runtime.errors import UserError

MODES = ("selfdistill", "sharegpt", "shipped", "served")


def collate(rows: list[dict[str, Any]], pad_id: int, hidden_path: Path | None = None,
            argmax: bool = False, hidden_layers: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into (B, T) tensors; padding has attention 0 and loss 0.

    With `hidden_path` (offline mode) the cached verifier hidden states come along as `hidden` (B, L, T, D) (the
    cache's layers, or `hidden_layers` of them, in that order), and with `argmax` M_q's cached greedy token at each
    position as `verifier_argmax` (B, T), -1 on padding.
    """
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.as_tensor(r["input_ids"])
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.as_tensor(r["loss_mask"])
    batch = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
    if hidden_path is not None:
        states = [load_hidden(hidden_path, r["row"], hidden_layers) for r in rows]  # (L, T_i, D) each
        hidden = states[0].new_zeros((len(rows), states[0].shape[0], width, states[0].shape[2]))
        for i, h in enumerate(states):
            hidden[i, :, : h.shape[1]] = h
        batch["hidden"] = hidden
        if argmax:
            greedy = torch.full((len(rows), width), -1, dtype=torch.long)
            for i, r in enumerate(rows):
                row = load_argmax(hidden_path, r["row"])
                greedy[i, : row.shape[0]] = row
            batch["verifier_argmax"] = greedy
    return batch


class DistillDataModule(L.LightningDataModule):
    """Training data for a drafter of `verifier`.

    Args:
        mode: `selfdistill` (the verifier answers the prompts), `sharegpt` (train on the conversations as given) or
            `shipped` (a set that ships with the toolkit, `shipped`: its name under shipped/data/ or its folder;
            data.shipped's files, verifier and chat template are checked, nothing is generated) or `served` (the
            record `python -m serve EXPORT --record DIR` kept, `source`: DIR; `shipped`, when given, names the
            shipped sets mixed in beside it, a replay sample such as `name@1200`).
        source: one source or a list of them (concatenated): `builtin` (its train split), a prompt/conversation file, a
        saved `datasets` directory, a Hub dataset
            id (`datasets.load_dataset`, split `hub_split`), or `selfgen` (the verifier writes the prompts,
            settings in `selfgen`: see data.selfgen.selfgen_conversations).
        shard_size: self-distillation writes a shard every `shard_size` prompts; a killed build resumes.
        eval_prompts: extra evaluation prompt files (MT-bench question.jsonl...) to decontaminate against, on top
            of the built-in eval split and HumanEval.
        limit: use the first `limit` conversations.
        min_shift: the smallest target offset the drafter learns (2 for Medusa head 1), to check there is something
            to learn after masking.
        cache_hidden_states: offline mode: compute the verifier hidden states of `hidden_layers` (set by train.py
            from the model) once, cache them on disk, and train from the cache instead of running the verifier.
            When the model asks for it (`verifier_argmax`, set by train.py: EAGLE-3), M_q's greedy token at every
            position is cached beside them (data.hidden_cache.build_argmax_cache) and batches carry it.
        reasoning: `train` (reasoning blocks in assistant turns are targets like the rest of the answer) or `mask`
            (they stay in the context with loss 0, so the drafter learns the answers only): for reasoning models'
            `<think>` ... `</think>` blocks (`reasoning_tags`), in every mode.
        cache_shard_rows: rows per hidden-state cache shard (the unit a killed build resumes from and DDP ranks
            split).
        group_by_length: training batches of similar lengths (random megabatches sorted by length), so they pad
            little; validation keeps its order.
    """

    def __init__(
        self,
        verifier: Verifier,
        cache_dir: str,
        mode: str = "selfdistill",
        source: str | list[str] = "builtin",
        limit: int | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        gen_batch_size: int = 32,
        max_length: int = 1024,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
        min_shift: int = 2,
        cache_hidden_states: bool = False,
        shard_size: int = 256,
        hub_split: str = "train",
        selfgen: dict[str, Any] | None = None,
        eval_prompts: list[str] | None = None,
        decontaminate: bool = True,
        group_by_length: bool = False,
        generator: str = "hf",
        shipped: str | list[str] | None = None,
        cache_shard_rows: int = 256,
        reasoning: str = "train",
        reasoning_tags: list[str] | tuple[str, str] = TAGS,
        prompt_loss: bool = False,
        regenerate: int = 0,
        regenerate_temperature: float = 0.8,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise UserError(f"data.mode={mode!r} is not one of {MODES}.")
        if source == "humaneval" or (not isinstance(source, str) and "humaneval" in list(source)):
            raise UserError("data.source=humaneval: HumanEval is kept for evaluation (python -m eval "
                            "prompts=humaneval) and is not a training source. Use builtin, a question.jsonl or a "
                            "ShareGPT file.")
        if prompt_loss and mode != "served":
            raise UserError(f"data.prompt_loss=true is for data=served (a server's record: the users' prompts are the "
                            f"serving domain's text); data.mode={mode!r} trains on the answers. Drop it, or use "
                            f"data=served data.source=DIR.")
        self.prompt_loss = bool(prompt_loss)
        if regenerate and mode != "served":
            raise UserError(f"data.regenerate={regenerate} has the verifier answer a served record's prompts again: "
                            f"it is for data=served (data.mode={mode!r} here). Drop it, or use data=served "
                            f"data.source=DIR.")
        if not isinstance(regenerate, int) or regenerate < 0:
            raise UserError(f"data.regenerate={regenerate!r}: give how many more answers the verifier writes to each "
                            f"recorded prompt, a whole number >= 0 (0: the recorded answers only).")
        if regenerate and not regenerate_temperature > 0:
            raise UserError(f"data.regenerate={regenerate} with data.regenerate_temperature={regenerate_temperature}: "
                            f"greedy decoding would write the recorded answer again. Give a temperature > 0 "
                            f"(0.8 by default).")
        self.regenerate, self.regenerate_temperature = regenerate, float(regenerate_temperature)
        self.verifier = verifier
        self.cache_dir = Path(cache_dir).expanduser()
        self.mode, self.source, self.limit = mode, source, limit
        self.max_new_tokens, self.temperature, self.gen_batch_size = max_new_tokens, temperature, gen_batch_size
        self.max_length, self.batch_size, self.val_fraction = max_length, batch_size, val_fraction
        self.seed, self.num_workers, self.min_shift = seed, num_workers, min_shift
        self.cache_hidden_states = cache_hidden_states
        self.shard_size, self.hub_split = shard_size, hub_split
        self.selfgen = dict(selfgen or {})
        self.eval_prompts, self.decontaminate = list(eval_prompts or []), decontaminate
        self.group_by_length = group_by_length
        if generator not in GENERATORS:
            raise UserError(f"data.generator={generator!r} is not one of {list(GENERATORS)} (hf: this process's "
                            f"batched refill generation; vllm: the real vLLM's offline batched generation).")
        self.generator = generator
        if mode == "shipped" and not shipped:
            raise UserError("data.mode=shipped needs data.shipped: the name of a set under shipped/data/ or its "
                            "folder (python train.py data=shipped sets the default verifier's).")
        self.shipped = shipped
        if cache_shard_rows < 1:
            raise UserError(f"data.cache_shard_rows={cache_shard_rows}: give a whole number of rows >= 1.")
        self.cache_shard_rows = cache_shard_rows
        if reasoning not in REASONING:
            raise UserError(f"data.reasoning={reasoning!r} is not one of {list(REASONING)} (train: learn the reasoning "
                            f"blocks too; mask: keep them as context with loss 0).")
        if len(reasoning_tags) != 2 or not all(isinstance(t, str) and t for t in reasoning_tags):
            raise UserError(f"data.reasoning_tags={list(reasoning_tags)}: give the opening and closing tag, e.g. "
                            f"['<think>', '</think>'].")
        self.reasoning, self.reasoning_tags = reasoning, tuple(reasoning_tags)
        self.hidden_layers: list[int] = [-1]
        self.verifier_argmax = False  # offline mode also caches M_q's argmax per position (needs layer -1 cached)
        self.hidden_path: Path | None = None
        self.train_set: datasets.Dataset | None = None
        self.val_set: datasets.Dataset | None = None

    def build(self) -> datasets.Dataset:
        """The full tokenised dataset (generated and cached on first use for self-distillation), with reasoning
        blocks masked where `reasoning=mask`."""
        ds = self._build()
        if self.reasoning == "mask":
            tok, tags = self.verifier.tokenizer, self.reasoning_tags
            ds = ds.map(lambda r: {"loss_mask": mask_reasoning(tok, r["input_ids"], r["loss_mask"], tags)},
                        desc="masking reasoning blocks")
        return ds

    def _build(self) -> datasets.Dataset:
        if self.mode == "shipped":
            ds = load_shipped(self.shipped, self.verifier)
            # Nested subsets: the first `limit` rows of one fixed permutation. The hidden-state cache is the whole
            # set's in that order, so every subset of the learning curve reads the one cache, and a subset needs
            # (and builds) only its leading shards.
            self._whole = ds.select(fixed_order(len(ds)))
            self._rows = list(range(len(ds) if self.limit is None else min(self.limit, len(ds))))
            return self._whole if self.limit is None else self._whole.select(self._rows)
        if self.mode == "served":
            return self.served()
        convs, groups = self.conversations(with_groups=True)
        if self.mode == "sharegpt":
            return build_sharegpt(self.verifier, convs, self.max_length)
        return build_selfdistill(
            self.verifier, convs, self.cache_dir, self.max_new_tokens, self.temperature,
            self.gen_batch_size, self.seed, self.max_length, self.shard_size, groups=groups, generator=self.generator,
        )

    def served(self) -> datasets.Dataset:
        """A served record (data.source) with the shipped sets data.shipped names beside it (a replay sample of what
        the drafter was trained on), in one fixed shuffle; `limit` takes its first rows."""
        if not isinstance(self.source, (str, Path)):
            raise UserError(f"data.mode=served reads one served record: data.source={self.source!r}; give the folder "
                            f"`python -m serve EXPORT --record DIR` wrote.")
        ds = load_served(self.source, self.verifier, self.max_length, prompt_loss=self.prompt_loss)
        if self.regenerate:
            ds = datasets.concatenate_datasets([ds, self.regenerated()])
        replay = [self.shipped] if isinstance(self.shipped, (str, Path)) else list(self.shipped or [])
        if replay:
            old = load_shipped(replay, self.verifier)
            ds = datasets.concatenate_datasets([ds, old])
        ds = ds.select(fixed_order(len(ds))).flatten_indices()
        return ds if self.limit is None else ds.select(range(min(self.limit, len(ds))))

    def regenerated(self) -> datasets.Dataset:
        """`regenerate` more answers to each of the record's chat prompts, the verifier's own, sampled at
        `regenerate_temperature` (each copy of a prompt seeded apart), up to `max_new_tokens`: self-distillation
        (data/selfdistill.py: generated in shards, cached, resumed after a kill) on the serving domain's prompts, each
        at its first user turn (`served_conversations`)."""
        convs = served_conversations(self.source, self.verifier)
        if not convs:
            raise UserError(f"data.regenerate={self.regenerate}: the served record {self.source} holds no finished "
                            f"chat request to answer again (completion requests keep no messages). Set "
                            f"data.regenerate=0.")
        copies = [Conversation(id=f"{c.id}-r{j}", category=c.category, messages=c.messages)
                  for j in range(self.regenerate) for c in convs]
        print(f"[data] regenerating {len(copies)} answers ({self.regenerate} to each of {len(convs)} recorded chat "
              f"prompts, temperature {self.regenerate_temperature}, up to {self.max_new_tokens} tokens)", flush=True)
        ds = build_selfdistill(self.verifier, copies, self.cache_dir, self.max_new_tokens, self.regenerate_temperature,
                               self.gen_batch_size, self.seed, self.max_length, self.shard_size,
                               generator=self.generator)
        return ds.add_column("source", [f"regenerated:{Path(self.source).name}"] * len(ds))

    def conversations(self, with_groups: bool = False) -> list[Conversation] | tuple[list[Conversation], list[int]]:
        """The training conversations: from each source in turn, decontaminated against every eval prompt, then
        limited. `with_groups`: also the number each source contributes, in order (None after `limit`, which mixes
        them), so self-distillation shards never straddle two sources and a source's shards serve any build."""
        sources = [self.source] if isinstance(self.source, str) else list(self.source)
        convs: list[Conversation] = []
        groups: list[int] | None = []
        guard = EvalGuard(eval_prompt_texts(self.eval_prompts)) if self.decontaminate else None
        for source in sources:
            if source == "selfgen":
                if self.mode != "selfdistill":
                    raise UserError("data.source=selfgen makes prompts only; use it with data.mode=selfdistill.")
                part = selfgen_conversations(self.verifier, self.cache_dir, **self.selfgen)
            else:
                part = load_conversations(str(Path(source).expanduser()) if Path(source).expanduser().exists()
                                          else source, split="train", hub_split=self.hub_split)
            if guard is not None:
                keep = apply_filters([c.user_turns[0] if c.user_turns else "" for c in part], None, guard, None,
                                     f"{source} against the eval prompts")
                part = [part[i] for i in keep]
            convs += part
            groups.append(len(part))
        if self.limit is not None:
            convs, groups = select_prompts(convs, self.limit), None
        if not convs:
            raise UserError(f"data.source={self.source!r}: no conversations left after decontamination. Check "
                            f"data.eval_prompts and the source.")
        return (convs, groups) if with_groups else convs

    def prepare_data(self) -> None:
        # One process per node generates the answers; setup() on every rank reads them and builds the hidden-state
        # cache together (each rank its share of the shards).
        if self.mode == "selfdistill":
            self.build()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        ds = self.build()
        check_has_targets(ds, self.min_shift, self.source)
        if len(ds) < 2:
            raise UserError(f"data from {self.source!r} has {len(ds)} conversation(s); need at least 2 for a "
                            f"train/val split.")
        if self.cache_hidden_states:
            whole, rows = self.cache_scope(ds)
            self.hidden_path = self.build_caches(whole, rows)
            ds = ds.add_column("row", rows)
        self.train_set, self.val_set = self.split(ds)
        n_tokens = sum(sum(m) for m in self.train_set["loss_mask"])
        print(f"[data] {len(self.train_set)} train / {len(self.val_set)} val conversations, "
              f"{n_tokens} assistant tokens to learn from")

    def split(self, ds: datasets.Dataset) -> tuple[datasets.Dataset, datasets.Dataset]:
        """(train, held-out): `val_fraction` of the rows (at least one), drawn with `seed`. The same settings give
        the same split, so scripts/tools/heldout_accuracy.py scores exactly the rows a run held out."""
        n_val = max(1, round(len(ds) * self.val_fraction))
        split = ds.train_test_split(test_size=n_val, seed=self.seed)
        return split["train"], split["test"]

    def cache_scope(self, ds: datasets.Dataset) -> tuple[datasets.Dataset, list[int]]:
        """(the dataset whose hidden-state cache serves `ds`, the cache row of each row of `ds`): the whole shipped
        set for a shipped subset (`limit`), so the subsets of a learning curve share one cache; else `ds` itself."""
        if self.mode == "shipped":
            return self._whole, self._rows
        return ds, list(range(len(ds)))

    @property
    def caches_argmax(self) -> bool:
        return self.cache_hidden_states and self.verifier_argmax and -1 in self.hidden_layers

    def build_caches(self, ds: datasets.Dataset, rows: list[int] | None = None) -> Path:
        """Offline mode's caches for `ds` (built once, resumable): the hidden states of `hidden_layers`, and M_q's
        argmax per position where `verifier_argmax` asks for it. Under DDP every rank builds its share of the shards
        (data.hidden_cache). Training then reads each batch's rows from disk, so the cache may exceed memory.
        Only the shards that hold `rows` are built where it is given (a shipped subset).
        Returns the hidden-state cache's directory."""
        rank, size = world()
        path = build_hidden_cache(self.verifier, ds, self.hidden_layers, self.cache_dir,
                                  shard_rows=self.cache_shard_rows, rank=rank, world=size, rows=rows)
        if self.caches_argmax:
            build_argmax_cache(self.verifier, path, len(ds), cache_layers(path).index(-1), rank=rank, world=size,
                               rows=rows)
        return path

    def _loader(self, ds: datasets.Dataset, shuffle: bool) -> DataLoader:
        """Training (`shuffle`): a StatefulDataLoader over an EpochSampler, so Lightning checkpoints the position in
        the epoch and a run resumed mid-epoch trains on exactly the batches an unbroken run would have. With
        `group_by_length`, batches of similar lengths (random megabatches of 50 batches, each sorted by length): on
        the 1,523 registry answers, random batches of 16 are 41% real tokens, grouped ones 93%."""
        pad = self.verifier.tokenizer.pad_token_id
        collate_fn = partial(collate, pad_id=pad, hidden_path=self.hidden_path, argmax=self.caches_argmax,
                             hidden_layers=self.hidden_layers)
        if not shuffle:
            return DataLoader(ds.with_format("python"), batch_size=self.batch_size, num_workers=self.num_workers,
                              collate_fn=collate_fn)
        lengths = [len(x) for x in ds["input_ids"]] if self.group_by_length else None
        sampler = EpochSampler(ds, seed=self.seed, lengths=lengths, batch_size=self.batch_size)
        return StatefulDataLoader(ds.with_format("python"), batch_size=self.batch_size, sampler=sampler,
                                  num_workers=self.num_workers, collate_fn=collate_fn)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

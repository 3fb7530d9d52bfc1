"""On-policy rollouts as training data (on-policy distillation: eval/rollout.py writes them, train/opd.py learns).

A rollout directory holds what a drafter did when it decoded a prompt pool with our exact decoder:

    rollout.json        the settings (export, family, chain depth, top-k, sampling, prompts), the verifier's
                        fingerprint, and once finished the acceptance it measured (tau, alpha_k)
    shard-00000.jsonl   one line per prompt, written whole (a temporary file renamed into place), so a killed
                        rollout resumes from its first missing shard

Each line: the prompt's `id` and `category`, `input_ids` (the prompt and the committed answer: exactly the tokens
the decoder emitted), `prompt_length`, `accept_lengths` (each round's accepted drafts) and `rounds`, one per
verified round (the last, cut short by max_new_tokens, is not recorded):
    start     the root's index in input_ids (the token the verifier chose last; the drafter drafts after it)
    drafts    the drafter's own chain d_1..d_K
    accepted  how many of them the rule accepted
    q_ids, q_probs  (K, k) M_q's top-k tokens and probabilities at the root and d_1..d_{K-1}: the distribution the
              verifier's one forward gave at each drafted position, accepted or rejected (draft d_{j+1}'s target)

`OnPolicyDataModule` serves the lines as rows of the ordinary training batch (input_ids, attention_mask,
loss_mask over the answer) with the rounds padded beside them (`collate_rounds`).
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from data.datamodule import collate
from data.sampler import EpochSampler
from models.verifiers.core import Verifier, check_fingerprint
from runtime.errors import UserError

FORMAT, VERSION = "specdraft-rollout", 1
MANIFEST = "rollout.json"


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.jsonl"


def write_shard(folder: Path, index: int, rows: list[dict[str, Any]]) -> Path:
    """Write one shard whole: a temporary file beside it, renamed into place (a killed write leaves no shard)."""
    path = shard_path(folder, index)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder).expanduser() / MANIFEST
    if not path.is_file():
        raise UserError(f"{str(folder)!r} is no rollout directory (no {MANIFEST}). Write one with python -m "
                        f"eval.rollout <export> --out {folder}.")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{path} is not a {FORMAT} v{VERSION} manifest (format {manifest.get('format')!r}, version "
                        f"{manifest.get('version')!r}). Write the rollout again with python -m eval.rollout.")
    return manifest


def read_rollout(folder: str | Path, verifier: Verifier | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(manifest, every recorded prompt's line, in shard order); with `verifier`, refused unless the rollout was
    made with that verifier (its fingerprint)."""
    folder = Path(folder).expanduser()
    manifest = read_manifest(folder)
    if verifier is not None:
        check_fingerprint(manifest["verifier_fingerprint"], verifier, f"rollout {folder}")
    rows = []
    for path in sorted(folder.glob("shard-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise UserError(f"rollout {folder} holds no finished shard yet: run python -m eval.rollout again with the "
                        f"same settings to resume it.")
    return manifest, rows


def training_row(line: dict[str, Any], max_length: int) -> dict[str, Any] | None:
    """A rollout line as a training row: the committed sequence (cut to `max_length`), its answer as the loss mask,
    and the rounds whose root lies inside it, as flat lists (Arrow keeps them). None: no round left."""
    ids = line["input_ids"][:max_length]
    prompt = int(line["prompt_length"])
    rounds = [r for r in line["rounds"] if 0 < r["start"] < len(ids)]
    if not rounds or len(ids) <= prompt:
        return None
    depth = max(len(r["drafts"]) for r in rounds)
    k = len(rounds[0]["q_ids"][0])

    def pad(values: list[Any], size: int, fill: Any) -> list[Any]:
        return list(values) + [fill] * (size - len(values))

    return {"input_ids": ids, "loss_mask": [0] * prompt + [1] * (len(ids) - prompt),
            "opd_start": [r["start"] for r in rounds], "opd_count": [len(r["drafts"]) for r in rounds],
            "opd_drafts": [pad(r["drafts"], depth, 0) for r in rounds],
            "opd_q_ids": [pad(r["q_ids"], depth, [0] * k) for r in rounds],
            "opd_q_probs": [pad(r["q_probs"], depth, [0.0] * k) for r in rounds]}


def collate_rounds(rows: list[dict[str, Any]], pad_id: int) -> dict[str, Tensor]:
    """The ordinary batch (data.datamodule.collate) and the rounds, padded to the batch's most rounds R and deepest
    chain K: opd_start (B, R) the root's index (-1: no round), opd_count (B, R) the drafts recorded, opd_drafts
    (B, R, K), opd_q_ids / opd_q_probs (B, R, K, k)."""
    batch = collate(rows, pad_id)
    most = max(len(r["opd_start"]) for r in rows)
    depth = max(len(d) for r in rows for d in r["opd_drafts"])
    k = len(rows[0]["opd_q_ids"][0][0])
    start = torch.full((len(rows), most), -1, dtype=torch.long)
    count = torch.zeros((len(rows), most), dtype=torch.long)
    drafts = torch.zeros((len(rows), most, depth), dtype=torch.long)
    q_ids = torch.zeros((len(rows), most, depth, k), dtype=torch.long)
    q_probs = torch.zeros((len(rows), most, depth, k), dtype=torch.float32)
    for i, r in enumerate(rows):
        m, d = len(r["opd_start"]), len(r["opd_drafts"][0])
        start[i, :m] = torch.as_tensor(r["opd_start"])
        count[i, :m] = torch.as_tensor(r["opd_count"])
        drafts[i, :m, :d] = torch.as_tensor(r["opd_drafts"])
        q_ids[i, :m, :d] = torch.as_tensor(r["opd_q_ids"])
        q_probs[i, :m, :d] = torch.as_tensor(r["opd_q_probs"])
    return batch | {"opd_start": start, "opd_count": count, "opd_drafts": drafts, "opd_q_ids": q_ids,
                    "opd_q_probs": q_probs}


class OnPolicyDataModule(L.LightningDataModule):
    """A rollout (eval/rollout.py) as training data: each prompt's committed sequence, its answer tokens the
    teacher-forced targets, its rounds the on-policy ones (train/opd.py).

    Args:
        verifier: the frozen M_q; the rollout must have been made with it (fingerprint).
        rollout: the rollout directory.
        max_length: sequences are cut to this many tokens (rounds whose root falls outside are dropped).
        batch_size, val_fraction, seed, num_workers: as data.datamodule.DistillDataModule's.
    """

    def __init__(self, verifier: Verifier, rollout: str | None = None, max_length: int = 1024, batch_size: int = 8,
                 val_fraction: float = 0.05, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        if not rollout:
            raise UserError("data=onpolicy needs data.rollout=<the directory python -m eval.rollout wrote>, e.g. "
                            "python -m eval.rollout pretrained/eagle3-smollm2 --out outputs/rollout-eagle3.")
        self.verifier, self.rollout = verifier, str(rollout)
        self.max_length, self.batch_size, self.val_fraction = max_length, batch_size, val_fraction
        self.seed, self.num_workers = seed, num_workers
        self.hidden_layers: list[int] = [-1]  # set by train.py; the verifier runs on every batch (no cache)
        self.verifier_argmax = False
        self.manifest: dict[str, Any] = {}
        self.train_set: datasets.Dataset | None = None
        self.val_set: datasets.Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.manifest, lines = read_rollout(self.rollout, self.verifier)
        rows = [r for r in (training_row(line, self.max_length) for line in lines) if r is not None]
        if len(rows) < 2:
            raise UserError(f"rollout {self.rollout} has {len(rows)} prompt(s) with a recorded round; need at least "
                            f"2 for a train/val split. Roll out more prompts (--num-prompts).")
        ds = datasets.Dataset.from_list(rows)
        n_val = max(1, round(len(ds) * self.val_fraction))
        split = ds.train_test_split(test_size=n_val, seed=self.seed)
        self.train_set, self.val_set = split["train"], split["test"]
        rounds = sum(len(r) for r in self.train_set["opd_start"])
        print(f"[data] rollout {self.rollout}: {len(self.train_set)} train / {len(self.val_set)} val prompts, "
              f"{rounds} recorded rounds to learn from on-policy")

    def _loader(self, ds: datasets.Dataset, shuffle: bool) -> DataLoader:
        fn = partial(collate_rounds, pad_id=self.verifier.tokenizer.pad_token_id)
        if not shuffle:
            return DataLoader(ds.with_format("python"), batch_size=self.batch_size, num_workers=self.num_workers,
                              collate_fn=fn)
        sampler = EpochSampler(ds, seed=self.seed, lengths=None, batch_size=self.batch_size)
        return StatefulDataLoader(ds.with_format("python"), batch_size=self.batch_size, sampler=sampler,
                                  num_workers=self.num_workers, collate_fn=fn)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(self.val_set, shuffle=False)

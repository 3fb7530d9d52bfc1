"""Training sets that ship with the toolkit: token ids and assistant-only loss masks in Parquet, with a manifest.

A shipped set is a folder (`shipped/data/<name>/`):

    manifest.json          what it is: the verifier's fingerprint, the chat template's sha256, the generation
                           settings, the sources with their counts and licences, the evaluation sets it was
                           decontaminated against, the counts, and every file's sha256 and size
    part-00000.parquet ... rows of id, category, source, input_ids (uint16 where the vocabulary fits, else int32)
                           and loss_mask (bool: 1 on the verifier's own answer tokens), zstd-compressed

`python train.py data=shipped` trains from it with no generation (`load_shipped`); a copy whose files do not match
their sha256, or that was made for another verifier or chat template, is refused with a message. `pack` writes
one from a self-distilled `datasets.Dataset` (scripts/tools/ship_data.py builds the default verifier's and packs it).
Any tool reads the parts: `datasets.load_dataset("parquet", data_files=...)`, pandas, DuckDB.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.selfdistill import FEATURES
from models.verifiers.core import Verifier, check_fingerprint, template_sha256
from runtime.errors import UserError
from runtime.io import atomic_dir

FORMAT = "specdraft-shipped-data"
VERSION = 1
MANIFEST = "manifest.json"
ROOT = Path(__file__).resolve().parents[1] / "shipped" / "data"  # the repository's shipped sets
ROWS_PER_PART = 4096


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def resolve(where: str | Path) -> Path:
    """A shipped set's folder: a path, or the name of one under the repository's shipped/data/."""
    path = Path(where).expanduser()
    if (path / MANIFEST).is_file():
        return path
    if (ROOT / str(where) / MANIFEST).is_file():
        return ROOT / str(where)
    names = sorted(p.parent.name for p in ROOT.glob(f"*/{MANIFEST}")) if ROOT.is_dir() else []
    raise UserError(f"data.shipped={str(where)!r}: no shipped set there (no {MANIFEST} in {path} or in "
                    f"{ROOT / str(where)}). Sets in this checkout: {names or 'none'}. Give one of them or the "
                    f"folder of a set written by scripts/tools/ship_data.py.")


def read_manifest(path: str | Path) -> dict[str, Any]:
    folder = resolve(path)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{folder / MANIFEST} is not valid JSON ({e}): the shipped set is damaged. Restore it "
                        f"(git checkout -- {folder}) or rebuild it with scripts/tools/ship_data.py.") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{folder / MANIFEST}: format {manifest.get('format')!r} version {manifest.get('version')!r}; "
                        f"this toolkit reads {FORMAT!r} version {VERSION}.")
    return manifest


def verify(folder: Path, manifest: dict[str, Any]) -> None:
    """Refuse a damaged copy: every file the manifest lists must be there with its size and sha256."""
    for entry in manifest["files"]:
        f = folder / entry["path"]
        if not f.is_file():
            raise UserError(f"shipped set {folder}: {entry['path']} is missing. Restore the folder (git checkout -- "
                            f"{folder}, or git lfs pull) or rebuild it with scripts/tools/ship_data.py.")
        digest = file_sha256(f)
        if f.stat().st_size != entry["bytes"] or digest != entry["sha256"]:
            raise UserError(f"shipped set {folder}: {entry['path']} is damaged (sha256 {digest[:16]}..., "
                            f"{f.stat().st_size} bytes; the manifest says {entry['sha256'][:16]}..., "
                            f"{entry['bytes']} bytes). Restore it (git checkout -- {folder}) or rebuild the set "
                            f"with scripts/tools/ship_data.py.")


def load_shipped(where: str | Path | Sequence[str | Path], verifier: Verifier) -> datasets.Dataset:
    """The shipped set at `where` as a dataset of FEATURES (the columns self-distillation writes, plus `source`),
    after checking its files, its verifier and its chat template against `verifier`. Several sets (a list: the
    short-prompt set and its long-input part) are each checked, then joined in the order given."""
    if not isinstance(where, (str, Path)):
        parts = [load_shipped(w, verifier) for w in where]
        if not parts:
            raise UserError("data.shipped=[]: name at least one shipped set.")
        if len(parts) == 1:
            return parts[0]
        # The joined set's fingerprint from its parts' (each from its files' digests): one hidden-state cache key.
        digest = hashlib.sha256("".join(p._fingerprint for p in parts).encode()).hexdigest()[:16]
        return datasets.Dataset(pa.concat_tables([p.data.table for p in parts]), fingerprint=f"shipped-{digest}")
    where, rows = split_rows(where)
    folder = resolve(where)
    manifest = read_manifest(folder)
    verify(folder, manifest)
    check_fingerprint(manifest["verifier_fingerprint"], verifier, f"shipped set {folder}")
    rendering = manifest.get("rendering", "chat")  # sets packed before the field were all chat-rendered
    if rendering != verifier.rendering:
        raise UserError(f"shipped set {folder} was rendered {rendering} but the verifier renders "
                        f"{verifier.rendering} (verifier.rendering): its prompts and loss masks would not be what the "
                        f"verifier sees. Use the set made for this rendering, or rebuild it "
                        f"(scripts/tools/ship_data.py).")
    template = template_sha256(verifier.tokenizer) if rendering == "chat" else None
    if manifest["chat_template_sha256"] != template:
        raise UserError(f"shipped set {folder} was rendered with another chat template (sha256 "
                        f"{manifest['chat_template_sha256'][:16]}...) than the verifier's tokenizer has "
                        f"({template[:16]}...): its loss masks would not match the turns. Use the tokenizer it was "
                        f"built with, or rebuild the set for this one (scripts/tools/ship_data.py).")
    table = pa.concat_tables([pq.read_table(folder / e["path"]) for e in manifest["files"]])
    features = datasets.Features({**FEATURES, "source": datasets.Value("string")})
    # A fingerprint from the files' digests: the same set gives the same hidden-state cache key on every run.
    digest = hashlib.sha256("".join(e["sha256"] for e in manifest["files"]).encode()).hexdigest()[:16]
    table = table.select(list(features)).cast(features.arrow_schema)
    ds = datasets.Dataset(table, fingerprint=f"shipped-{digest}")
    counts = manifest["counts"]
    if len(ds) != counts["conversations"]:
        raise UserError(f"shipped set {folder}: {len(ds)} rows, the manifest says {counts['conversations']}; the set "
                        f"is damaged. Restore it or rebuild it with scripts/tools/ship_data.py.")
    if rows is None:
        return ds
    if not 1 <= rows <= len(ds):
        raise UserError(f"data.shipped: '{where}@{rows}' asks for {rows} rows of a set of {len(ds)}; give 1 to "
                        f"{len(ds)}, or drop '@{rows}' for the whole set.")
    picked = ds.select(fixed_order(len(ds))[:rows]).flatten_indices()  # name@N: the rows data.limit=N takes
    return datasets.Dataset(picked.data.table, fingerprint=f"shipped-{digest}-{rows}")


def fixed_order(n: int) -> np.ndarray:
    """The one fixed shuffle of a shipped set's n rows: data.limit=N (datamodule) and name@N both take its first N,
    so smaller subsets nest in larger ones and share the whole set's hidden-state cache."""
    return np.random.default_rng(0).permutation(n)


def split_rows(where: str | Path) -> tuple[str | Path, int | None]:
    """A data.shipped entry and the rows it asks for: `name@N` is the set's first N rows of its fixed permutation (a
    replay sample of an older set beside a new one), `name` the whole set."""
    text = str(where)
    if "@" not in text:
        return where, None
    name, _, count = text.rpartition("@")
    if not count.isdigit():
        raise UserError(f"data.shipped: '{text}' ends in '@{count}', which is not a row count; write name@N (N rows "
                        f"of the set) or the name alone.")
    return name, int(count)


def check_replaceable(out: str | Path, force: bool = False) -> None:
    """`pack` replaces `out` whole: refuse a folder that holds anything but a shipped set (a file, a folder of other
    things, other files beside a set) unless `force`, so a folder the user named is never deleted by mistake."""
    out = Path(out).expanduser()
    if force or not out.exists() and not out.is_symlink():
        return
    fix = ("Pack into a new or empty folder (ship.out=...), move what it holds elsewhere first, or replace it with "
           "ship.force=true")
    if not out.is_dir():
        raise UserError(f"{out} is not a folder, and packing a shipped set there would delete it. {fix}.")
    entries = sorted(e.name for e in out.iterdir())
    if not entries:
        return
    try:
        is_set = json.loads((out / MANIFEST).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        is_set = False
    foreign = [e for e in entries if e != MANIFEST and not re.fullmatch(r"part-\d{5}\.parquet", e)]
    if not is_set or foreign:
        shown = foreign or entries
        what = (f"a shipped set and also {shown[:4]}" if is_set else f"no shipped set but {shown[:4]}") + (
            f" and {len(shown) - 4} more" if len(shown) > 4 else "")
        raise UserError(f"{out} holds {what}; packing a shipped set there would replace the whole folder and delete "
                        f"it. {fix}.")


def pack(ds: datasets.Dataset, out: str | Path, verifier: Verifier, info: dict[str, Any],
         rows_per_part: int = ROWS_PER_PART, force: bool = False) -> dict[str, Any]:
    """Write `ds` (id, category, input_ids, loss_mask, source) as a shipped set in `out`, atomically, with its
    manifest: `info` adds the generation settings, sources, decontamination and how it was built. Returns the
    manifest. A folder holding anything but a shipped set is refused unless `force` (`check_replaceable`)."""
    check_replaceable(out, force)
    missing = {"id", "category", "input_ids", "loss_mask", "source"} - set(ds.column_names)
    if missing:
        raise ValueError(f"pack needs the columns {sorted(missing)}")
    vocab = verifier.vocab_size
    ids_type = pa.uint16() if vocab <= 1 << 16 else pa.int32()
    schema = pa.schema([("id", pa.string()), ("category", pa.string()), ("source", pa.string()),
                        ("input_ids", pa.list_(ids_type)), ("loss_mask", pa.list_(pa.bool_()))])
    out = Path(out)
    files = []
    with atomic_dir(out) as tmp:
        for part, start in enumerate(range(0, len(ds), rows_per_part)):
            rows = ds.select(range(start, min(start + rows_per_part, len(ds))))
            table = pa.table({"id": rows["id"], "category": rows["category"], "source": rows["source"],
                              "input_ids": rows["input_ids"],
                              "loss_mask": [[bool(m) for m in r] for r in rows["loss_mask"]]},
                             schema=schema)
            name = f"part-{part:05d}.parquet"
            pq.write_table(table, tmp / name, compression="zstd", compression_level=19, use_dictionary=["category",
                           "source"], row_group_size=1024)
            files.append({"path": name, "rows": len(rows), "bytes": (tmp / name).stat().st_size,
                          "sha256": file_sha256(tmp / name)})
        by_source: dict[str, dict[str, int]] = {}
        for src, mask, ids in zip(ds["source"], ds["loss_mask"], ds["input_ids"]):
            c = by_source.setdefault(src, {"conversations": 0, "assistant_tokens": 0, "tokens": 0})
            c["conversations"] += 1
            c["assistant_tokens"] += int(sum(mask))
            c["tokens"] += len(ids)
        manifest = {
            "format": FORMAT, "version": VERSION, "name": out.name,
            "verifier": verifier.source, "verifier_name": verifier.name,
            "verifier_fingerprint": verifier.fingerprint,
            "rendering": verifier.rendering,  # plain: a base model's text, no chat template to record
            "chat_template_sha256": template_sha256(verifier.tokenizer) if verifier.rendering == "chat" else None,
            "eos_token_id": verifier.tokenizer.eos_token_id,
            "counts": {"conversations": len(ds),
                       "assistant_tokens": sum(c["assistant_tokens"] for c in by_source.values()),
                       "tokens": sum(c["tokens"] for c in by_source.values())},
            "by_source": by_source,
            **info,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest

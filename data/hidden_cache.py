"""Offline mode: the frozen verifier's hidden states computed once and cached on disk, as EAGLE's offline mode does.

Training then reads them instead of running the verifier every epoch. One safetensors file per sequence holds the
requested layers as a (L, T, D) bfloat16 tensor; layer ids index HF `output_hidden_states` (0 = embeddings, i = the
input of layer i, -1 = the final-normed last hidden state). The cache is keyed by the verifier fingerprint, the
dataset and the layers, written in shards (each atomic; a killed build resumes), and its disk size is printed first.

Beside a cache that holds the final-normed layer (-1), `build_argmax_cache` stores M_q's greedy token at every
position (the argmax of its lm_head over those states), for drafters whose targets need it (EAGLE-3 keeps only the
targets whose argmax its draft vocabulary holds): a full-vocabulary projection per token, computed once instead of
once per epoch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm.auto import tqdm

from models.packed import Linear
from models.verifiers.core import Verifier
from runtime.distributed import barrier
from runtime.errors import UserError
from runtime.io import atomic_dir, write_new_files

DTYPE = torch.bfloat16


def hidden_cache_dir(verifier: Verifier, ds: datasets.Dataset, layers: list[int], cache_dir: str | Path) -> Path:
    key = json.dumps({"verifier": verifier.fingerprint, "data": ds._fingerprint, "layers": layers}, sort_keys=True)
    return Path(cache_dir).expanduser() / "hidden" / hashlib.sha256(key.encode()).hexdigest()[:16]


def cache_layers(path: Path) -> list[int]:
    """The layer ids a cache directory holds, in its stored order."""
    for name in ("done.json", "meta.json"):
        if (path / name).is_file():
            return list(json.loads((path / name).read_text())["layers"])
    raise FileNotFoundError(f"{path} is not a hidden-state cache (no done.json or meta.json)")


def superset_cache(verifier: Verifier, ds: datasets.Dataset, layers: list[int], cache_dir: str | Path) -> Path | None:
    """A finished cache of the same verifier and dataset that holds every layer of `layers` (and more), if one
    exists: e.g. EAGLE-3's [2, 15, 27, -1] serves EAGLE-1 and Medusa's [-1], so one build serves all three. A cache
    qualifies only if its own key (verifier fingerprint, dataset fingerprint, its layers) names its directory."""
    root = Path(cache_dir).expanduser() / "hidden"
    for done in sorted(root.glob("*/done.json")):
        held = json.loads(done.read_text()).get("layers", [])
        if set(layers) <= set(held) and hidden_cache_dir(verifier, ds, held, cache_dir) == done.parent:
            return done.parent
    return None


@torch.no_grad()
def build_hidden_cache(verifier: Verifier, ds: datasets.Dataset, layers: list[int], cache_dir: str | Path,
                       batch_size: int = 8, shard_rows: int = 256, rank: int = 0, world: int = 1,
                       rows: list[int] | None = None) -> Path:
    """Compute and store the hidden states of `layers` for every row of `ds` (once); returns the cache directory.
    With `rows`, only the shards that hold those rows are built (a nested subset of a shipped set reads the leading
    shards of the whole set's cache): the cache is finished (`done.json`) once a later build has written the rest.
    A finished cache of the same verifier and data holding more layers is used instead (`superset_cache`): read it
    with `load_hidden(path, row, layers)`.

    Rows are written in shards of `shard_rows` (`<path>/<shard:05d>/<row>.safetensors`), each shard atomically with
    a `shard.json` naming the verifier fingerprint, the layers and its rows, so a killed build keeps its finished
    shards and the next call computes only the missing ones, and a shard of another verifier or layer set is refused.
    With several processes (`rank` of `world`, e.g. DDP ranks) each computes the missing shards i with
    i % world == rank, none twice; then every rank waits for the others (a process-group barrier) and checks that
    every shard is there. A rank that was killed leaves its shards missing: any later run, with any number of
    processes, computes them. The build is refused when the shards still to write cannot fit the free disk.
    """
    path = hidden_cache_dir(verifier, ds, layers, cache_dir)
    lengths = [len(ids) for ids in ds["input_ids"]]
    if (path / "done.json").is_file():
        check_finished_cache(path, lengths, verifier.hidden_size)
        return path
    wider = superset_cache(verifier, ds, layers, cache_dir)
    if wider is not None:
        check_finished_cache(wider, lengths, verifier.hidden_size)
        if rank == 0:
            print(f"[data] hidden-state cache: layers {layers} are in the finished cache of layers "
                  f"{cache_layers(wider)} ({wider}); reading them from it, nothing to build")
        return wider
    per_token = len(layers) * verifier.hidden_size * torch.finfo(DTYPE).bits // 8
    if rank == 0:
        print(f"[data] caching verifier hidden states of layers {layers} for {len(ds)} sequences ({sum(lengths)} "
              f"tokens): {sum(lengths) * per_token / 2**30:.2f} GiB in {path}"
              + (f", shards split over {world} processes" if world > 1 else ""))
    path.mkdir(parents=True, exist_ok=True)
    meta = path / "meta.json"
    if meta.is_file():
        shard_rows = json.loads(meta.read_text())["shard_rows"]  # a resumed build keeps its shard layout
    else:
        write_json_atomic(meta, {"shard_rows": shard_rows, "layers": layers, "verifier": verifier.fingerprint})
    starts = list(range(0, len(ds), shard_rows))
    needed = starts if rows is None else sorted({r // shard_rows * shard_rows for r in rows})
    present = [s for s in starts if (path / f"{s // shard_rows:05d}").is_dir()]
    expected = {"verifier": verifier.fingerprint, "layers": list(layers)}
    damaged = {}
    for s in present:
        folder, end = path / f"{s // shard_rows:05d}", min(s + shard_rows, len(ds))
        check_shard(folder, expected, s, end)
        damage = shard_damage(folder, s, end, lengths, len(layers), verifier.hidden_size)
        if damage is not None:
            damaged[s] = damage
    done = {s for s in present if s not in damaged}
    if damaged and rank == 0:
        for s, damage in sorted(damaged.items()):
            print(f"[data] hidden-state cache: shard {s // shard_rows:05d} {damage}: computing it again"
                  + ("" if s in needed else " when a run reads its rows"))
    todo = [s for s in needed if s not in done]
    need = sum(sum(lengths[s: s + shard_rows]) for s in todo) * per_token
    free = shutil.disk_usage(path).free
    if need > free:
        raise UserError(f"the hidden-state cache needs {need / 2**30:.2f} GiB more in {path}, and its disk has "
                        f"{free / 2**30:.2f} GiB free. Free space, point cache_dir= at a larger disk, or cache fewer "
                        f"rows (data.limit=) or layers.")
    mine = [s for s in todo if (s // shard_rows) % world == rank]
    if done and rank == 0:
        print(f"[data] hidden-state cache: resuming, {len(done)} of {len(starts)} shards already written")
    if len(needed) < len(starts) and rank == 0:
        print(f"[data] hidden-state cache: building the {len(needed)} of {len(starts)} shards that hold the rows this "
              f"run reads ({len(todo)} still to write, {need / 2**30:.2f} GiB); a run that reads the rest builds them")
    bar = tqdm(total=sum(min(shard_rows, len(ds) - s) for s in mine), desc="caching hidden states", unit="seq",
               dynamic_ncols=True, disable=rank != 0)
    decoder = verifier.model.get_decoder()
    for start in mine:
        end = min(start + shard_rows, len(ds))
        with atomic_dir(path / f"{start // shard_rows:05d}") as tmp:
            rows = ds[start:end]["input_ids"]
            sizes = {}  # file -> bytes, so a later read finds a truncated file without opening its tensors
            for offset, ids in enumerate(rows):  # one sequence at a time: no padding to store or strip
                out = decoder(input_ids=torch.tensor([ids], device=verifier.device), output_hidden_states=True,
                              use_cache=False)
                stacked = torch.stack([out.hidden_states[i][0] for i in layers])  # (L, T, D)
                file = tmp / f"{start + offset}.safetensors"
                save_file({"hidden": stacked.to("cpu", DTYPE).contiguous()}, str(file))
                sizes[file.name] = file.stat().st_size
                bar.update(1)
            (tmp / "shard.json").write_text(json.dumps(expected | {"rows": [start, end], "rank": rank,
                                                                    "world": world, "sizes": sizes}))
    bar.close()
    barrier()
    missing = [s // shard_rows for s in needed if not (path / f"{s // shard_rows:05d}").is_dir()]
    if missing:
        raise UserError(f"the hidden-state cache {path} lacks {len(missing)} of {len(needed)} shards (e.g. "
                        f"{missing[:5]}): a process building them stopped. Run again: the finished shards are kept "
                        f"and the missing ones are computed.")
    still_damaged = [s for s in damaged if s not in needed]  # outside this run's rows: rebuilt when read
    if rank == 0 and not still_damaged and all((path / f"{s // shard_rows:05d}").is_dir() for s in starts):
        write_json_atomic(path / "done.json", {"layers": layers, "sequences": len(ds), "tokens": sum(lengths),
                                               "verifier": verifier.fingerprint})
    barrier()
    return path


def check_shard(folder: Path, expected: dict, start: int, end: int) -> None:
    """Refuse a finished shard written for another verifier, layer set or row range (shards from before shard.json
    existed are taken as they are; an unreadable shard.json is left to `shard_damage`)."""
    got = _shard_info(folder)
    if not got:
        return
    for key, want in (*expected.items(), ("rows", [start, end])):
        if got.get(key) != want:
            raise UserError(f"hidden-state cache shard {folder} was written with {key}={got.get(key)!r}, but this "
                            f"cache is for {key}={want!r}: it was copied from another cache. Delete {folder} (it is "
                            f"computed again) or the whole cache folder {folder.parent}.")


def _shard_info(folder: Path) -> dict | None:
    """A shard's shard.json, {} when it has none (written before it existed), None when it cannot be read."""
    info = folder / "shard.json"
    if not info.is_file():
        return {}
    try:
        got = json.loads(info.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return got if isinstance(got, dict) else None


def _header_damage(file: Path, size: int, shape: tuple[int, int, int]) -> str | None:
    """What is wrong with a row file, from its safetensors header alone (8 bytes of length, then JSON), or None:
    a header that does not parse, a tensor of another shape, or data that ends before or after the file does."""
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            return f"{file.name} has {size} bytes, too few for its header (truncated)"
        try:
            header = json.loads(f.read(n))
            entry = header["hidden"]
            got, end = tuple(entry["shape"]), int(entry["data_offsets"][1])
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError):
            return f"{file.name} has an unreadable safetensors header"
    if got != shape:
        return f"{file.name} holds a tensor of shape {list(got)}, {list(shape)} expected (layers, tokens, hidden)"
    if 8 + n + end != size:
        return f"{file.name} has {size} bytes, its header describes {8 + n + end} (truncated or overwritten)"
    return None


def shard_damage(folder: Path, start: int, end: int, lengths: list[int], num_layers: int,
                 hidden_size: int) -> str | None:
    """Why the shard `folder` (rows start..end-1) cannot be read, or None when it can: its folder or a row's file
    missing, a file whose size differs from the one recorded when it was written (shard.json `sizes`, absent in
    older caches), or a header that does not describe the file (`_header_damage`). Reads headers, not tensors."""
    if not folder.is_dir():
        return "is missing (its folder is gone)"
    info = _shard_info(folder)
    if info is None:
        return "has an unreadable shard.json"
    sizes = info.get("sizes") or {}
    for row in range(start, end):
        file = folder / f"{row}.safetensors"
        if not file.is_file():
            return f"lacks {file.name}"
        size = file.stat().st_size
        if sizes.get(file.name) not in (None, size):
            return f"{file.name} has {size} bytes, {sizes[file.name]} when it was written (truncated or overwritten)"
        damage = _header_damage(file, size, (num_layers, lengths[row], hidden_size))
        if damage is not None:
            return damage
    return None


def check_finished_cache(path: Path, lengths: list[int], hidden_size: int) -> None:
    """Refuse a finished cache (done.json) with a missing or damaged shard before training reads it: one message
    naming the shard, what is wrong and the command that rebuilds just it (the build then keeps the good shards and
    computes the damaged one again). Cheap: file sizes and safetensors headers, no tensor is read."""
    rows = _shard_rows(path)
    num_layers = len(cache_layers(path))
    spans = [(path, 0, len(lengths))] if rows is None else [
        (path / f"{s // rows:05d}", s, min(s + rows, len(lengths))) for s in range(0, len(lengths), rows)]
    for folder, start, end in spans:
        damage = shard_damage(folder, start, end, lengths, num_layers, hidden_size)
        if damage is None:
            continue
        fix = (f"rm -rf '{folder}' '{path / 'done.json'}', then run the same command again: it computes this shard "
               f"({end - start} rows) and keeps the other {len(spans) - 1}" if rows is not None else
               f"rm -rf '{path}' and run the same command again (this cache, written before shards, is rebuilt whole)")
        raise UserError(f"the hidden-state cache {path} is damaged: shard {folder.name} {damage}. Rebuild just it: "
                        f"{fix}.")


def write_json_atomic(path: Path, value: dict) -> None:
    """A marker file written whole or not at all, and on disk before the call returns (runtime.io.write_new_files)."""
    write_new_files({path: json.dumps(value)}, replace=True)


@functools.lru_cache(maxsize=64)
def _shard_rows(path: Path) -> int | None:
    meta = path / "meta.json"
    return json.loads(meta.read_text())["shard_rows"] if meta.is_file() else None  # None: an older, flat cache


@functools.lru_cache(maxsize=64)
def _layer_index(path: Path, layers: tuple[int, ...]) -> tuple[int, ...] | None:
    held = cache_layers(path)
    return None if list(layers) == held else tuple(held.index(layer) for layer in layers)


def load_hidden(path: Path, row: int, layers: list[int] | None = None) -> Tensor:
    """The cached (L, T, D) hidden states of dataset row `row`: every layer the cache holds, or `layers` (ids, in
    that order), read alone from the file (a cache of more layers serves a drafter that needs fewer)."""
    rows = _shard_rows(path)
    folder = path if rows is None else path / f"{row // rows:05d}"
    file = str(folder / f"{row}.safetensors")
    index = None if layers is None else _layer_index(path, tuple(layers))
    if index is None:
        return load_file(file)["hidden"]
    with safe_open(file, framework="pt") as f:
        part = f.get_slice("hidden")
        return torch.cat([part[i : i + 1] for i in index])


ARGMAX_ROWS = 256  # rows per file of the argmax cache


def _argmax_file(path: Path, row: int) -> Path:
    return path / "argmax" / f"{row // ARGMAX_ROWS:05d}" / "argmax.safetensors"


@torch.no_grad()
def build_argmax_cache(verifier: Verifier, path: Path, num_rows: int, final_index: int, rank: int = 0,
                       world: int = 1, rows: list[int] | None = None) -> Path:
    """M_q's greedy token (int32, per position) for every cached row: the argmax of the verifier's lm_head over the
    cached final-normed states (`final_index`: where layer -1 sits in the cache's layers), in the verifier's dtype
    (bf16 through the prepacked head on CPU). Written in groups of ARGMAX_ROWS rows, each atomically, so a killed
    build keeps its finished groups; returns `path / "argmax"`. With several processes (`rank` of `world`) each
    computes the missing groups i with i % world == rank, then all wait for each other. With `rows`, only the
    groups that hold those rows."""
    starts = range(0, num_rows, ARGMAX_ROWS) if rows is None else sorted({r // ARGMAX_ROWS * ARGMAX_ROWS for r in rows})
    todo = [s for s in starts if not _argmax_file(path, s).is_file()]
    mine = [s for s in todo if (s // ARGMAX_ROWS) % world == rank]
    if mine and rank == 0:
        print(f"[data] caching M_q's argmax at every position of {num_rows} cached sequences "
              f"({len(starts) - len(todo)} of {len(starts)} groups already written)")
    if mine:
        weight = verifier.lm_head.weight.detach()
        bias = getattr(verifier.lm_head, "bias", None)
        head = Linear(weight, None if bias is None else bias.detach(), packed=True)
        bar = tqdm(total=sum(min(ARGMAX_ROWS, num_rows - s) for s in mine), desc="caching M_q argmax", unit="seq",
                   dynamic_ncols=True, disable=rank != 0)
        for start in mine:
            with atomic_dir(_argmax_file(path, start).parent) as tmp:
                rows = {}
                for row in range(start, min(start + ARGMAX_ROWS, num_rows)):
                    final = load_hidden(path, row)[final_index].to(weight.device, weight.dtype)  # (T, D)
                    rows[str(row)] = head(final).float().argmax(-1).to(torch.int32)
                    bar.update(1)
                save_file(rows, str(tmp / "argmax.safetensors"))
        bar.close()
    barrier()
    missing = [s // ARGMAX_ROWS for s in starts if not _argmax_file(path, s).is_file()]
    if missing:
        raise UserError(f"the argmax cache {path / 'argmax'} lacks {len(missing)} of {len(starts)} groups (e.g. "
                        f"{missing[:5]}): a process building them stopped. Run again: the finished groups are kept.")
    return path / "argmax"


@functools.lru_cache(maxsize=4)
def _argmax_group(file: Path) -> dict[str, Tensor]:
    return load_file(str(file))


def load_argmax(path: Path, row: int) -> Tensor:
    """M_q's cached greedy token at each position of dataset row `row` (T,), from `build_argmax_cache`."""
    return _argmax_group(_argmax_file(path, row))[str(row)]


def gather_layers(batch: dict[str, Tensor], layers: list[int], verifier: Verifier,
                  wanted: list[int]) -> dict[int, Tensor]:
    """The hidden states `wanted` (layer ids), from the batch's cache when it has them, else one verifier forward.

    Returns {layer id: (B, T, D)}; -1 is the final-normed hidden state (the lm_head input).
    """
    if "hidden" in batch:
        index = {layer: i for i, layer in enumerate(layers)}
        return {w: batch["hidden"][:, index[w]].to(verifier.dtype) for w in wanted}
    with torch.no_grad():
        out = verifier.model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                           output_hidden_states=True, use_cache=False)
    return {w: out.hidden_states[w] for w in wanted}

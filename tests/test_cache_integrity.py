"""The dequantised verifier cache detects damage, and the verifier fingerprint covers every weight."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT
from models.verifiers.core import check_fingerprint, fingerprint
from models.verifiers.embedded import (
    MANIFEST,
    SMOLLM2_CACHE_NAME,
    ensure_smollm2_checkpoint,
    load_smollm2,
    write_manifest,
)
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError, VerifierMismatchError


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A verifier cache dequantised from the GGUF once for this module (~20 s) into a fresh SPECDRAFT_CACHE."""
    cache = tmp_path_factory.mktemp("cache")
    ensure_smollm2_checkpoint(cache)
    return cache


@pytest.fixture
def copy(built, tmp_path) -> tuple[Path, Path]:
    """A private copy of the built cache: (cache root, verifier directory inside it)."""
    root = tmp_path / "cache"
    shutil.copytree(built, root)
    return root, root / "verifiers" / SMOLLM2_CACHE_NAME


def test_the_build_records_sizes_and_hashes(built):
    directory = built / "verifiers" / SMOLLM2_CACHE_NAME
    files = json.loads((directory / MANIFEST).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    weights = files["model.safetensors"]
    assert weights["size"] == (directory / "model.safetensors").stat().st_size and len(weights["sha256"]) == 64
    assert not [p for p in built.joinpath("verifiers").iterdir() if p.name.startswith(".")]  # no scratch left


def _flip_bytes(path: Path, offset_fraction: float = 0.5, n: int = 4096) -> None:
    """Overwrite n bytes in the middle of a file with 0xFF (a NaN pattern for fp32 weights), keeping its size."""
    with open(path, "r+b") as f:
        f.seek(int(path.stat().st_size * offset_fraction))
        f.write(b"\xff" * n)


def test_overwritten_weights_are_refused_naming_the_directory(copy):
    root, directory = copy
    _flip_bytes(directory / "model.safetensors")
    with pytest.raises(UserError, match="sha256 differs") as err:
        load_smollm2(cache_dir=str(root), device="cpu")
    assert f"rm -rf '{directory}'" in str(err.value) and "model.safetensors" in str(err.value)


def test_a_truncated_cache_is_refused_even_after_it_was_hashed(copy):
    root, directory = copy
    load_smollm2(cache_dir=str(root), device="cpu")  # whole: hashes checked once for this process
    weights = directory / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(UserError, match=r"model.safetensors has \d+ bytes, \d+ when it was built"):
        load_smollm2(cache_dir=str(root), device="cpu")


def test_a_broken_config_is_one_message(copy):
    root, directory = copy
    (directory / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json has"):
        ensure_smollm2_checkpoint(root)
    write_manifest(directory)  # even when the manifest agrees with the broken file, loading fails with one message
    with pytest.raises(UserError, match="does not load") as err:
        load_smollm2(cache_dir=str(root), device="cpu")
    assert "damaged" in str(err.value) and str(directory) in str(err.value)


def test_damaged_cache_on_the_command_line_prints_one_message(copy, tmp_path):
    root, directory = copy
    (directory / "tokenizer.json").write_bytes(b"\x00" * 10)
    env = {**os.environ, "SPECDRAFT_CACHE": str(root)}
    proc = subprocess.run([sys.executable, "train.py", "verifier=tiny", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: the verifier cache" in proc.stderr and "Traceback" not in proc.stderr


def test_a_cache_without_manifest_is_rebuilt(copy):
    root, directory = copy
    (directory / MANIFEST).unlink()
    _flip_bytes(directory / "model.safetensors")  # an older cache, damaged: no way to tell, so it is rebuilt
    ensure_smollm2_checkpoint(root)
    assert (directory / MANIFEST).is_file()
    v = load_smollm2(cache_dir=str(root), device="cpu")
    assert all(torch.isfinite(p).all() for p in v.model.parameters())


# -- the fingerprint ------------------------------------------------------------------------------------------------
def test_fingerprint_changes_with_any_weight_not_only_the_lm_head(tiny, cache_dir):
    other = build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu")
    with torch.no_grad():
        other.model.model.layers[1].mlp.down_proj.weight[3, 5] += 0.5  # one weight in one layer
    fp = fingerprint(other.model)
    assert fp["lm_head_sha256"] == tiny.fingerprint["lm_head_sha256"]
    assert fp["weights_sha256"] != tiny.fingerprint["weights_sha256"]
    with pytest.raises(VerifierMismatchError, match="weights_sha256"):
        check_fingerprint(fp, tiny, "export 'x'")


def test_fingerprint_is_the_same_in_bf16_and_fp32(tiny, cache_dir):
    bf16 = build_tiny(cache_dir=cache_dir, dtype="bfloat16", device="cpu")
    assert bf16.fingerprint == tiny.fingerprint


def test_exports_written_before_the_wider_fingerprint_still_load(tiny):
    old = {k: v for k, v in tiny.fingerprint.items() if k != "weights_sha256"}
    check_fingerprint(old, tiny, "export 'old'")  # accepted on the keys it has
    with pytest.raises(VerifierMismatchError):
        check_fingerprint({**old, "lm_head_sha256": "0" * 16}, tiny, "export 'old'")
    with pytest.raises(VerifierMismatchError):
        check_fingerprint({}, tiny, "export 'none'")  # no fingerprint at all is still refused


# -- atomic replacement of an export ----------------------------------------------------------------------------------
WRITER = r"""
import os, signal, sys
from pathlib import Path
import runtime.io as io

final, version, kill_at = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if kill_at.startswith("fallback+"):
    io.exchange = lambda a, b: False  # a file system without RENAME_EXCHANGE
    kill_at = kill_at[len("fallback+"):]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def wrap(name, fn):
    calls = []
    def wrapped(*args, **kwargs):
        calls.append(1)
        if kill_at == f"{name}:before" or kill_at == f"{name}:before#{len(calls)}":
            die()
        out = fn(*args, **kwargs)
        if kill_at == f"{name}:after" or kill_at == f"{name}:after#{len(calls)}":
            die()
        return out
    return wrapped

io.fsync_tree = wrap("fsync_tree", io.fsync_tree)
io.exchange = wrap("exchange", io.exchange)
io.shutil.rmtree = wrap("rmtree", io.shutil.rmtree)
io.os.rename = wrap("rename", io.os.rename)
with io.atomic_dir(final) as tmp:
    (tmp / "weights.bin").write_bytes(version.encode() * 100_000)
    if kill_at == "body":
        die()
    (tmp / "config.json").write_text(version)
print("done")
"""


def _write(final: Path, version: str, kill_at: str = "none") -> int:
    proc = subprocess.run([sys.executable, "-c", WRITER, str(final), version, kill_at], cwd=ROOT, timeout=120)
    return proc.returncode


def _version(final: Path) -> str:
    """The version `final` holds, asserting it is complete and consistent."""
    version = (final / "config.json").read_text()
    assert (final / "weights.bin").read_bytes() == version.encode() * 100_000
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "weights.bin"]
    return version


@pytest.mark.parametrize("kill_at,expect", [("body", "old"), ("fsync_tree:before", "old"),
                                            ("exchange:before", "old"), ("exchange:after", "new"),
                                            ("rmtree:before", "new"), ("rename:after#1", None)])
def test_a_kill_during_an_export_swap_leaves_the_old_or_the_new_version(tmp_path, kill_at, expect):
    """SIGKILL the writer at each step of replacing an export: the export is always one whole version."""
    final = tmp_path / "export"
    assert _write(final, "old") == 0
    rc = _write(final, "new", kill_at)
    assert rc == -signal.SIGKILL or (expect is None and rc == 0)  # a rename is not needed to replace, with exchange
    got = _version(final)  # asserts it is whole
    assert got in ("old", "new") and (expect is None or got == expect)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "export"]
    assert all(n.startswith(".tmp-export-") for n in leftovers)
    assert _write(final, "newer") == 0  # the next writer cleans up after the dead one
    assert _version(final) == "newer" and [p.name for p in tmp_path.iterdir()] == ["export"]


def test_without_exchange_a_kill_between_the_renames_is_recovered(tmp_path):
    from runtime.io import recover

    final = tmp_path / "export"
    assert _write(final, "old") == 0
    assert _write(final, "new", "fallback+rename:after#1") == -signal.SIGKILL  # old moved aside, new not yet in
    assert not final.exists()
    recover(final)  # what the next atomic_dir on this path does first
    assert _version(final) == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_a_live_writers_scratch_directory_is_left_alone(tmp_path):
    from runtime.io import recover

    final = tmp_path / "export"
    mine = tmp_path / f".tmp-export-{os.getpid()}-abc"
    dead = tmp_path / ".tmp-export-999999999-abc"  # above any pid_max: no such process
    mine.mkdir()
    dead.mkdir()
    recover(final)
    assert mine.is_dir() and not dead.exists()

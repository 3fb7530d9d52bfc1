"""The dequantised verifier cache detects damage, and the verifier fingerprint covers every weight."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from models.errors import UserError, VerifierMismatchError
from models.verifier import (MANIFEST, SMOLLM2_CACHE_NAME, build_tiny, check_fingerprint, ensure_smollm2_checkpoint,
                             fingerprint, load_smollm2, write_manifest)


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

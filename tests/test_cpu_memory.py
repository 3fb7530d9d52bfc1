"""runtime.cpu_memory: with freed memory kept, a large tensor comes from glibc's heap (not a fresh mmap, which is
page-faulted in afresh every time) and stays in the heap once freed, for the next step to reuse. Read through glibc's
own accounting (mallinfo2), in a fresh process each, since the setting is process-wide."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import ctypes, json, sys, torch
from runtime.cpu_memory import keep_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2()
x = torch.ones(16 * 2**20)  # 64 MB, as large as a training step's logits
alive = libc.mallinfo2()
del x
freed = libc.mallinfo2()
mb = lambda n: n / 2**20
print(json.dumps({"applied": applied, "mapped_mb": mb(alive.hblkhd - before.hblkhd),
                  "heap_grew_mb": mb(alive.arena - before.arena), "heap_kept_mb": mb(freed.arena - before.arena)}))
"""


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_tensors_come_from_the_heap_and_stay_there():
    system = _probe("system")
    assert system["mapped_mb"] >= 64 and system["heap_kept_mb"] < 64  # the default: its own mmap, unmapped on free
    kept = _probe("keep")
    assert kept["applied"] is True
    assert kept["mapped_mb"] < 1 and kept["heap_grew_mb"] >= 64  # from the heap
    assert kept["heap_kept_mb"] >= 64  # and kept there once freed


def test_training_bounds_onednns_primitive_cache_unless_the_user_set_it(train_script, tmp_path, monkeypatch):
    """A training step's bf16 matmuls change shape with every batch, and oneDNN keeps a primitive per shape (1,024 by
    default): DFlash over the full vocabulary grew ~0.5 GB a step until the kernel killed it. train.py bounds the
    cache before its first tensor work; a capacity the user set is kept."""
    import os

    from helpers import compose_train
    from runtime.cpu_memory import ONEDNN_CACHE, ONEDNN_CACHE_ENTRIES, bound_onednn_cache

    monkeypatch.delenv(ONEDNN_CACHE, raising=False)
    tiny = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
            "model=medusa", "logger=csv", "+trainer.fast_dev_run=true"]
    train_script.run(compose_train(tiny, tmp_path))
    assert os.environ[ONEDNN_CACHE] == str(ONEDNN_CACHE_ENTRIES)
    monkeypatch.setenv(ONEDNN_CACHE, "7")
    assert bound_onednn_cache() == "7" and os.environ[ONEDNN_CACHE] == "7"

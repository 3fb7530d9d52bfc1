"""Keep freed memory in the process on CPU (glibc), so large tensors are not faulted in afresh at every step.

glibc serves allocations above its mmap threshold (at most 32 MB) with a fresh `mmap` and returns them with `munmap`
on free. A training step on CPU allocates many tensors that size or larger (EAGLE-3's (N, 8,192) fp32 logits and
their gradients are 60 MB each at batch 8), so every step page-faults them in again: measured on the default
EAGLE-3 step, that is ~40% of its time. `keep_freed_memory` makes glibc serve every allocation from its heap and
keep what is freed for reuse (the `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...` environment settings, applied from
inside the process through `mallopt`). The cost: the process keeps its peak memory until it exits.

`bound_onednn_cache` bounds oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY, default 1,024 entries). Every
new shape of a bf16 matmul creates a primitive the cache keeps, and a training step's shapes change with every batch
(rows per unrolled step, the last chunk of a chunked loss): measured on DFlash over the full vocabulary under
`lk_hybrid`, batch 16, the process grew ~0.5 GB a step (4.5 GB to 19 GB in 30 steps); with 32 entries it held at
5.0 GB, with none at 3.3 GB, at the same step time (docs/results/objectives.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes: freed memory at the top of the heap stays
ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_ENTRIES = 32  # measured: 5.0 GB held where the default grew past 19 GB, no slower


def bound_onednn_cache(entries: int = ONEDNN_CACHE_ENTRIES) -> str:
    """Bound oneDNN's primitive cache for this process (and the processes it starts), unless the user set it; returns
    the capacity in force. oneDNN reads it once, at its first primitive: call it before any tensor work."""
    return os.environ.setdefault(ONEDNN_CACHE, str(entries))


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and keep freed memory in the process (glibc's mallopt). Returns False
    where there is no glibc `mallopt` (macOS, musl), leaving the allocator as it was."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))

"""The worker keeps the host memory it frees, so that a step does not fault its buffers in again.

Each step allocates and frees the same activations (megabytes each at prefill sizes). glibc's
malloc decides by heuristics whether a freed block goes back to the operating system: blocks
above its mmap threshold are unmapped on free, and free memory at the top of a heap beyond its
trim threshold is returned. Both thresholds adapt to what the process frees, and whether they
adapt in time depends on the order of its first allocations. Measured on the 2-core AMX Xeon, a
worker with an int8 KV cache faulted 430-460 thousand pages in each 64×256×128 run (0.75-0.9 s of
system time, its steps with prompt tokens 350-375 ms) where the same worker with the thresholds
fixed faulted 5-12 thousand (prompt steps 307-328 ms). So the worker fixes them at start: blocks
up to 32 MiB (glibc's largest mmap threshold) come from the heaps, and freed memory stays in them
up to 1 GiB (RSS then stays at its peak, as a serving process's does anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Fix glibc malloc's mmap and trim thresholds (above); False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False  # a C library without mallopt (musl, macOS)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not kept:
        log.warning(
            "could not fix malloc's thresholds: freed host memory may be returned and faulted in again"
        )
    return kept

"""How the worker holds host memory: it keeps what it frees, and it asks for huge pages.

**Freed memory is kept**, so that a step does not fault its buffers in again.

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

**Huge pages.** A CPU decode step streams every weight and the whole KV context once, through
4 KiB pages: a TLB miss, and a page walk, every 4 KiB of hundreds of megabytes. Where Linux has
transparent huge pages in `madvise` mode (the common default), memory gets 2 MiB pages only where
the process asks, and glibc's malloc asks for all of its memory when started with the tunable
`glibc.malloc.hugetlb=1` (glibc 2.35 on). The tunable is read when the process starts, so a worker
started without it runs itself again with it (`huge_page_environment`), before importing torch.
Measured on the 2-core AMX Xeon, `bench/cpu_step.py` in bfloat16 over three paired runs (decode
steps at 320 tokens of context): one sequence 9.3-10.2 ms a step against 10.2-10.3, 64 sequences
41.8-42.7 against 42.5-43.6, 64 on an int8 KV cache 33.5-35.3 against 35.6-36.1; served, 64×256×128
ran 1.03× as fast (median of 5 paired rounds). A 2 MiB page faults in slower than 512 small ones
on that VM, so a server became ready 0.75-1.0 s later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"  # 1: madvise(MADV_HUGEPAGE) on what malloc maps
FIRST_GLIBC_WITH_IT = (2, 35)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _libc_function(name: str) -> Any | None:
    """The C library's function `name`, or None where there is no such function (a C library
    other than glibc: musl, macOS)."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Fix glibc malloc's mmap and trim thresholds (above); False where the C library is not glibc."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not kept:
        log.warning(
            "could not fix malloc's thresholds: freed host memory may be returned and faulted in again"
        )
    return kept


def return_free_memory() -> bool:
    """Give the operating system back the free pages of malloc's heaps (glibc's malloc_trim):
    kept free memory is for a step's buffers, not for what loading the weights freed once. False
    where the C library has no malloc_trim (not glibc)."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


def transparent_huge_pages(setting: Path = THP_SETTING) -> str:
    """Linux's transparent huge page mode: "always", "madvise" or "never" (the bracketed choice of
    `setting`), or "unavailable" where there is no such file (another OS, a kernel without THP)."""
    try:
        text = setting.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def glibc_version() -> tuple[int, int] | None:
    """The running C library's version where it is glibc, else None."""
    name, version = platform.libc_ver()
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def huge_page_tunable(environ: Mapping[str, str]) -> str | None:
    """The value GLIBC_TUNABLES gives HUGE_PAGE_TUNABLE in `environ`, or None where it is unset."""
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name == HUGE_PAGE_TUNABLE:
            return value
    return None


def huge_page_environment(
    environ: Mapping[str, str], thp_mode: str, libc: tuple[int, int] | None
) -> dict[str, str] | None:
    """The environment to start the worker again in so that malloc asks for huge pages (`environ`
    with HUGE_PAGE_TUNABLE=1 added to GLIBC_TUNABLES), or None where that would change nothing:
    the tunable is already set (to any value: the user's choice stands), THP is not in `madvise`
    mode (`always` gives every region huge pages anyway, `never` none), or the C library is not a
    glibc that knows the tunable."""
    if huge_page_tunable(environ) is not None:
        return None
    if thp_mode != "madvise" or libc is None or libc < FIRST_GLIBC_WITH_IT:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    added = f"{HUGE_PAGE_TUNABLE}=1"
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{added}" if tunables else added}


def restart_with_huge_pages() -> None:
    """Replace this process by itself started again (same executable, arguments and PID) with
    malloc asking for huge pages, where `huge_page_environment` says that changes something;
    else return. Call it first thing, before threads and large imports."""
    environ = huge_page_environment(os.environ, transparent_huge_pages(), glibc_version())
    if environ is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def huge_pages_in_effect() -> str:
    """What this process's memory is paged in, for the log."""
    mode = transparent_huge_pages()
    if mode == "always":
        return "2 MiB pages where aligned (transparent huge pages: always)"
    value = huge_page_tunable(os.environ)
    if value is None:
        return f"4 KiB pages (transparent huge pages: {mode}; {HUGE_PAGE_TUNABLE} unset)"
    if value == "1" and mode == "madvise":
        return f"2 MiB pages where aligned (transparent huge pages: madvise; {HUGE_PAGE_TUNABLE}=1)"
    return f"as {HUGE_PAGE_TUNABLE}={value} gives (transparent huge pages: {mode})"

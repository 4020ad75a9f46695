"""The worker's malloc settings (gpu_worker/host_memory.py), checked in a fresh process each."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.host_memory import (
    glibc_version,
    huge_page_environment,
    transparent_huge_pages,
)

# Allocates and frees 24 MiB, then reports how much free memory the heaps keep (mallinfo2's
# fordblks): in a fresh process glibc maps a block that large on its own and unmaps it on free.
PROBE = """
import ctypes, sys
from gpu_worker.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
block = libc.malloc(24 << 20)
ctypes.memset(block, 1, 24 << 20)
libc.free(block)
print(libc.mallinfo2().fordblks)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_freed_blocks_stay_in_the_heap_once_the_thresholds_are_fixed() -> None:
    kept = {}
    for mode in ("default", "keep"):
        done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        kept[mode] = int(done.stdout)
    assert kept["default"] < 1 << 20, kept  # unmapped on free
    assert kept["keep"] >= 24 << 20, kept  # kept for the next step


# With the thresholds fixed, 24 MiB freed stays resident; return_free_memory gives it back.
TRIM_PROBE = """
import ctypes
from gpu_worker.host_memory import keep_freed_memory, return_free_memory

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
assert keep_freed_memory()
block = libc.malloc(24 << 20)
ctypes.memset(block, 1, 24 << 20)
libc.free(block)
kept = resident()
assert return_free_memory()
print(kept - resident())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_memory_freed_into_the_heap_goes_back_to_the_system_when_asked() -> None:
    done = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True)
    assert int(done.stdout) >= 20 << 20, done.stdout


def test_transparent_huge_pages_reads_the_bracketed_mode(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert transparent_huge_pages(setting) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert transparent_huge_pages(setting) == "always"
    assert transparent_huge_pages(tmp_path / "missing") == "unavailable"


def test_huge_page_environment_adds_the_tunable_only_where_it_changes_something() -> None:
    glibc = (2, 36)
    assert huge_page_environment({"PATH": "/bin"}, "madvise", glibc) == {
        "PATH": "/bin",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
    }
    # Other tunables are kept, the new one appended.
    assert huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", glibc) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    }
    # Already set, to any value: the user's choice stands (and a restarted worker does not restart again).
    assert huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", glibc) is None
    assert huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", glibc) is None
    # THP gives every region huge pages already, or none at all; or the C library lacks the tunable.
    for mode in ("always", "never", "unavailable"):
        assert huge_page_environment({}, mode, glibc) is None
    assert huge_page_environment({}, "madvise", None) is None
    assert huge_page_environment({}, "madvise", (2, 34)) is None


# Prints a line, then restarts itself with huge pages where that changes something; then reports
# its tunables and how much of 64 MiB it just wrote is in huge pages.
RESTART_PROBE = """
import ctypes, os
print("started", flush=True)
from gpu_worker.host_memory import restart_with_huge_pages
restart_with_huge_pages()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
block = libc.malloc(64 << 20)
ctypes.memset(block, 1, 64 << 20)
huge = [line for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")]
print(os.environ.get("GLIBC_TUNABLES", ""))
print(int(huge[0].split()[1]) if huge else 0)
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="transparent huge pages are Linux's")
def test_a_restarted_process_asks_malloc_for_huge_pages_once() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    expected = huge_page_environment(environ, transparent_huge_pages(), glibc_version())
    done = subprocess.run(
        [sys.executable, "-c", RESTART_PROBE], capture_output=True, text=True, check=True, env=environ
    )
    lines = done.stdout.splitlines()
    if expected is None:  # this machine's THP mode or C library: nothing to ask for, no restart
        assert lines[0] == "started" and lines[1] == "", done.stdout
        return
    assert lines[:2] == ["started", "started"], done.stdout  # once again, not in a loop
    assert lines[2] == "glibc.malloc.hugetlb=1"
    assert int(lines[3]) >= 32 << 10, done.stdout  # KiB: most of the 64 MiB block


def test_the_log_says_what_the_tunable_and_thp_mode_give(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpu_worker.host_memory as host_memory

    def report(mode: str, tunables: str | None) -> str:
        monkeypatch.setattr(host_memory, "transparent_huge_pages", lambda: mode)
        if tunables is None:
            monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
        else:
            monkeypatch.setenv("GLIBC_TUNABLES", tunables)
        return host_memory.huge_pages_in_effect()

    assert report("madvise", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1") == (
        "2 MiB pages where aligned (transparent huge pages: madvise; glibc.malloc.hugetlb=1)"
    )
    assert (
        report("madvise", None) == "4 KiB pages (transparent huge pages: madvise; glibc.malloc.hugetlb unset)"
    )
    assert (
        report("never", "glibc.malloc.hugetlb=1")
        == "as glibc.malloc.hugetlb=1 gives (transparent huge pages: never)"
    )
    assert report("madvise", "glibc.malloc.hugetlb=2") == (
        "as glibc.malloc.hugetlb=2 gives (transparent huge pages: madvise)"
    )
    assert report("always", None) == "2 MiB pages where aligned (transparent huge pages: always)"

"""The worker's malloc settings (gpu_worker/host_memory.py), checked in a fresh process each."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

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

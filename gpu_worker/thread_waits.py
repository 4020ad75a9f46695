"""How long the worker's idle OpenMP threads spin before they sleep (`--omp-spin-count`).

torch's CPU ops and duoserve's C kernels share one OpenMP runtime, libgomp. A libgomp thread that
finds no work (at a barrier, or between parallel regions) checks again GOMP_SPINCOUNT times
before it sleeps on a futex; unset, that is 300,000 checks, a few milliseconds on current CPUs.
On cores that only the worker uses, that long spin is harmless. But when another process takes
one of them, a thread that waits for a partner who lost its core spins for its whole time slice,
and every parallel region of a step pays that. On a 2-core Zen 4, beside one busy process, a
served bfloat16 decode step took 357-971 ms for one sequence (6.4-7.4 ms idle) and 1.4-1.7 s for
64 (50-56 ms idle); spinning 1,000 times, 19-20 ms and 106-107 ms, within the twice that losing a
core costs (`bench/contention.py`, bench/results/issue4-zen4-session51.md). On an otherwise idle
machine the shorter spin lets a thread sleep in some gaps between regions, which costs a little:
served 64x256x128 ran at 0.96-1.00x the long spin's throughput, a single stream at 0.89-0.97x. A
host that runs nothing beside the worker can set GOMP_SPINCOUNT=300000 (or `--omp-spin-count
300000`).

libgomp reads these variables once, when it is loaded, so the worker sets them before it imports
torch. GOMP_SPINCOUNT or OMP_WAIT_POLICY already in the environment are the user's choice, and
stand.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

SPIN_COUNT = "GOMP_SPINCOUNT"
WAIT_POLICY = "OMP_WAIT_POLICY"
OPENMP_RUNTIME_USERS = ("torch",)  # modules that load libgomp when imported


def spin_environment(environ: Mapping[str, str], spin_count: int) -> dict[str, str]:
    """The variables to add to `environ` so that libgomp spins `spin_count` times: none where
    the environment already says how its threads wait."""
    if SPIN_COUNT in environ or WAIT_POLICY in environ:
        return {}
    return {SPIN_COUNT: str(spin_count)}


def set_spin_count(spin_count: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set GOMP_SPINCOUNT for this process's OpenMP runtime (see spin_environment). Call it
    before torch is imported: libgomp would not read it afterwards."""
    if any(name in sys.modules for name in OPENMP_RUNTIME_USERS):
        raise RuntimeError("the OpenMP runtime is loaded already: set its spin count before importing torch")
    environ.update(spin_environment(environ, spin_count))


def thread_waits_in_effect(environ: Mapping[str, str] = os.environ) -> str:
    """How the OpenMP threads wait, for the log."""
    if WAIT_POLICY in environ:
        return f"as {WAIT_POLICY}={environ[WAIT_POLICY]} says" + (
            f" ({SPIN_COUNT}={environ[SPIN_COUNT]})" if SPIN_COUNT in environ else ""
        )
    if SPIN_COUNT in environ:
        return f"spin {environ[SPIN_COUNT]} times, then sleep ({SPIN_COUNT})"
    return "as the OpenMP runtime's defaults say"

"""Compile ahead, side by side, the CPU kernels whose builds do not depend on a model's shapes.

    python -m kernels.cpu_prebuild      # or: make kernels

The block linear's two builds take longest of all the CPU kernels: 15 s for float32 x and 28 s
for bfloat16 on a 2-core Zen 4 (GCC 12), each compiled in three parts side by side. Here the two
builds start together, on a thread each, into the kernel cache (kernels/cpu_build.py) where a
worker's first start and the tests find them; the fused ops and the pair-layout linear follow on
whichever thread is free first. All five took 45 s on that machine. `make test` runs this beside the
type checks, so the compiles take the second core while mypy takes the first. A kernel this CPU
cannot run is reported and skipped, as a worker skips it for its torch path; any other
KernelBuildError (no compiler, a failed compile) exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from kernels.cpu_block_linear import open_library, require_cpu
from kernels.cpu_build import KernelBuildError, cache_dir, cpu_has, side_by_side
from kernels.cpu_fused import load_cpu_fused_ops
from kernels.cpu_pair_linear import load_pair_linear

# A named build, and what runs it: "" once built, else why this CPU cannot run the kernel.
Build = tuple[str, Callable[[], str]]


def _block_linear(dtype: torch.dtype) -> Callable[[], str]:
    def build() -> str:
        try:
            require_cpu()
        except KernelBuildError as exc:
            return str(exc)
        open_library(dtype)
        return ""

    return build


def _fused_ops(dtype: torch.dtype) -> Callable[[], str]:
    def build() -> str:
        load_cpu_fused_ops(dtype)  # portable C: any CPU
        return ""

    return build


def _pair_linear() -> str:
    if not cpu_has("avx512_bf16") and not cpu_has("amx_bf16"):
        return "the pair-layout linear needs AVX-512 BF16 or AMX-BF16"
    load_pair_linear()
    return ""


# The longest first: each thread takes the next build when it is done with one.
BUILDS: list[Build] = [
    ("block linear, bfloat16 x", _block_linear(torch.bfloat16)),
    ("block linear, float32 x", _block_linear(torch.float32)),
    ("fused ops, float32", _fused_ops(torch.float32)),
    ("fused ops, bfloat16", _fused_ops(torch.bfloat16)),
    ("pair-layout linear", _pair_linear),
]


def _timed(build: Callable[[], str]) -> Callable[[], tuple[float, str]]:
    def run() -> tuple[float, str]:
        started = time.perf_counter()
        skipped = build()
        return time.perf_counter() - started, skipped

    return run


def prebuild(threads: int | None = None) -> list[tuple[str, float, str]]:
    """Each build's name, seconds, and why it was skipped ("" where it was built)."""
    timings = side_by_side([_timed(build) for _, build in BUILDS], threads)
    return [(name, seconds, skipped) for (name, _), (seconds, skipped) in zip(BUILDS, timings, strict=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="builds at once (default: one a CPU)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        done = prebuild(args.threads)
    except KernelBuildError as exc:
        print(f"kernel build failed: {exc}", file=sys.stderr)
        return 1
    for name, seconds, skipped in done:
        print(f"{name}: {f'skipped ({skipped})' if skipped else f'ready in {seconds:.1f} s'}")
    print(f"CPU kernels in {cache_dir()} ready in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""y = x @ weight.T (+ bias) for one or two rows of x in bfloat16: a C kernel that streams the weights.

A decode step of one or two sequences reads every weight once and does almost nothing with it,
so its linears run at the speed weights stream from memory. oneDNN's packed kernel reaches
about 12 GB/s there on this machine; `kernels/cpu/small_batch_linear.c` reads each weight row
once, contiguously, for all rows of x, with AVX-512 BF16 dot products, and reaches about 16
(bench: a whole SmolLM2 layer stack at one row, 16.9 ms against 21.8 ms). From four rows on
oneDNN is faster, so the worker calls this only for up to MAX_ROWS rows
(gpu_worker/linear.py). It needs AVX-512 BF16; elsewhere `load_small_batch_linear` raises
`KernelBuildError`.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch

from kernels._launch import require
from kernels.cpu_build import KernelBuildError, build, load

MAX_ROWS = 2

_lock = threading.Lock()
_function: Callable[..., None] | None = None


# The C signature both CPU linear kernels share: x, x_stride, weight, bias, y, rows, n, k, threads.
LINEAR_ARGTYPES: list[Any] = [
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int,
]


def check_input(x: torch.Tensor) -> None:
    require(
        x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(1) == 1,
        "x",
        x,
        "a bfloat16 [rows, in] CPU tensor with contiguous rows",
    )


def check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None:
        require(
            bias.shape == (n,) and bias.dtype == torch.bfloat16 and bias.is_contiguous(),
            "bias",
            bias,
            f"a contiguous bfloat16 [{n}] tensor",
        )


def run_linear(
    function: Callable[..., None], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """y [rows, n] from a kernel of LINEAR_ARGTYPES' signature, its arguments checked."""
    rows, k = x.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    if rows:
        function(
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            k,
            torch.get_num_threads(),
        )
    return out


class SmallBatchLinear:
    """The loaded kernel; call it like F.linear on bfloat16 tensors with at most MAX_ROWS rows."""

    def __init__(self, function: Callable[..., None]) -> None:
        self._function = function

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        check_input(x)
        rows, k = x.shape
        require(1 <= rows <= MAX_ROWS, "x", x, f"1..{MAX_ROWS} rows")
        require(
            weight.dim() == 2
            and weight.dtype == torch.bfloat16
            and weight.is_contiguous()
            and weight.shape[1] == k,
            "weight",
            weight,
            f"a contiguous bfloat16 [out, {k}] tensor",
        )
        n = weight.shape[0]
        require(k % 32 == 0 and n % 16 == 0, "weight", weight, "in a multiple of 32, out a multiple of 16")
        check_bias(bias, n)
        return run_linear(self._function, x, weight, bias, n)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether the kernel takes this weight's shape and layout."""
        return (
            weight.dim() == 2
            and weight.dtype == torch.bfloat16
            and weight.is_contiguous()
            and weight.shape[1] % 32 == 0
            and weight.shape[0] % 16 == 0
        )


def load_small_batch_linear() -> SmallBatchLinear:
    """Build (or find in the cache) and load the kernel; KernelBuildError where it cannot run."""
    global _function
    with _lock:
        if _function is None:
            function = load(build("small_batch_linear.c", {"MAX_ROWS": MAX_ROWS})).duoserve_small_batch_linear
            function.restype = None
            function.argtypes = LINEAR_ARGTYPES
            _function = function
        return SmallBatchLinear(_function)


__all__ = ["MAX_ROWS", "KernelBuildError", "SmallBatchLinear", "load_small_batch_linear"]

"""y = x @ weight.T (+ bias) in bfloat16 on AMX tiles, for decode-sized batches (1 to MAX_ROWS rows).

A decode step's linears stream every weight once and do little with it. oneDNN's packed kernel
(gpu_worker/linear.py) is tuned for large batches; `kernels/cpu/amx_linear.c` packs each weight
once into the tiles' layout (one contiguous strip of the input dimension per 16 outputs) and
streams the strips. Measured here over the four linears of SmolLM2's 30 layers: 5.9 ms at two
rows (the AVX-512 BF16 small-batch kernel: 8.1), 8.4 at 16 (oneDNN: 12.0), 15.5 at 64 (oneDNN:
16.8); past 64 rows oneDNN is faster (128: 23.3 against 25.3), and far faster on prefill chunks.

It needs AMX-BF16 and a Linux kernel that grants the tile state; elsewhere `load_amx_linear`
raises `KernelBuildError` and the worker keeps the other kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kernels._launch import require
from kernels.cpu_build import KernelBuildError, build, load
from kernels.cpu_linear import LINEAR_ARGTYPES, check_bias, check_input, run_linear

MAX_ROWS = 64  # the worker takes oneDNN past this

_lock = threading.Lock()
_function: Callable[..., None] | None = None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] → the tile layout [n / 16, k / 32, 16, 16, 2]: for each 16 outputs, their
    inputs in steps of 32, each step 16 rows of (output, input pair)."""
    require(AmxLinear.supports(weight), "weight", weight, "a contiguous bfloat16 [n, k], k in 32s, n in 16s")
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


class AmxLinear:
    """The loaded kernel; call it with x and a weight from `pack`."""

    def __init__(self, function: Callable[..., None]) -> None:
        self._function = function

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether the kernel takes this weight's shape and layout."""
        return (
            weight.dim() == 2
            and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and weight.shape[1] % 32 == 0
            and weight.shape[0] % 16 == 0
        )

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        check_input(x)
        k = x.shape[1]
        require(
            packed.dim() == 5
            and packed.dtype == torch.bfloat16
            and packed.is_contiguous()
            and packed.shape[1:] == (k // 32, 16, 16, 2)
            and k % 32 == 0,
            "packed",
            packed,
            f"a weight of input size {k} from kernels.cpu_amx.pack",
        )
        n = packed.shape[0] * 16
        check_bias(bias, n)
        return run_linear(self._function, x, packed, bias, n)


def load_amx_linear() -> AmxLinear:
    """Build (or find in the cache) and load the kernel; KernelBuildError where it cannot run."""
    global _function
    with _lock:
        if _function is None:
            library = load(build("amx_linear.c", {}))
            if library.duoserve_amx_init() != 0:
                raise KernelBuildError("the Linux kernel did not grant this process the AMX tile state")
            function = library.duoserve_amx_linear
            function.restype = None
            function.argtypes = LINEAR_ARGTYPES
            _function = function
        return AmxLinear(_function)


__all__ = ["MAX_ROWS", "AmxLinear", "KernelBuildError", "load_amx_linear", "pack"]

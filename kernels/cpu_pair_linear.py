"""y = x @ weight.T (+ bias) in bfloat16 on weights packed in pairs, for decode-sized batches (1
to MAX_ROWS rows).

A decode step's linears stream every weight once and do little with it. oneDNN's packed kernel
(gpu_worker/linear.py) is tuned for large batches; `kernels/cpu/pair_linear.c` packs each weight
once into bfloat16 pairs (one contiguous strip of the input dimension per 16 outputs), the
layout that both AMX tiles and AVX-512 BF16 dot products take, and streams the strips. It is
built with one of two engines: AMX tiles where the CPU has AMX-BF16 and Linux grants the tile
state, else AVX-512 BF16 dot products. Measured over the four linears of SmolLM2's 30 layers,
weights from memory:
- AMX, on a 2-core Intel Xeon: 5.9 ms at two rows (a plain-layout kernel that streamed each
  weight row for one or two rows, since removed: 8.1), 8.4 at 16 (oneDNN: 12.0), 15.5 at 64
  (oneDNN: 16.8);
- dot products, on a 2-core AMD EPYC: 6.4 ms at one or two rows (the plain-layout kernel:
  7.4-8.0; oneDNN: 10.8), 10.9 at 16 (oneDNN: 14.2), 33.0 at 64 (oneDNN: 38.3-49.8), 65 at 128
  (oneDNN: 75).
The worker sends batches past MAX_ROWS to oneDNN, which is as fast or faster on prefill chunks.
Where the CPU has neither engine, `load_pair_linear` raises `KernelBuildError` and oneDNN takes
every batch.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch

from kernels._launch import require
from kernels.cpu_build import KernelBuildError, load_engine

MAX_ROWS = 64  # the worker takes oneDNN past this

_lock = threading.Lock()
_functions: dict[bool, tuple[Callable[..., None], str]] = {}

# duoserve_pair_linear(x, x_stride, packed weight, bias, y, rows, n, k, threads)
_ARGTYPES: list[Any] = [
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


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] → the pair layout [n / 16, k / 32, 16, 16, 2]: for each 16 outputs, their
    inputs in steps of 32, each step 16 rows of (output, input pair)."""
    require(PairLinear.supports(weight), "weight", weight, "a contiguous bfloat16 [n, k], k in 32s, n in 16s")
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


class PairLinear:
    """The loaded kernel; call it with x and a weight from `pack`."""

    def __init__(self, function: Callable[..., None], engine: str) -> None:
        self._function = function
        self.engine = engine  # what multiplies: cpu_build.AMX or cpu_build.BF16_DOT

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
        require(
            x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(1) == 1,
            "x",
            x,
            "a bfloat16 [rows, in] CPU tensor with contiguous rows",
        )
        rows, k = x.shape
        require(
            packed.dim() == 5
            and packed.dtype == torch.bfloat16
            and packed.is_contiguous()
            and packed.shape[1:] == (k // 32, 16, 16, 2)
            and k % 32 == 0,
            "packed",
            packed,
            f"a weight of input size {k} from kernels.cpu_pair_linear.pack",
        )
        n = packed.shape[0] * 16
        if bias is not None:
            require(
                bias.shape == (n,) and bias.dtype == torch.bfloat16 and bias.is_contiguous(),
                "bias",
                bias,
                f"a contiguous bfloat16 [{n}] tensor",
            )
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        if rows:
            self._function(
                x.data_ptr(),
                x.stride(0),
                packed.data_ptr(),
                None if bias is None else bias.data_ptr(),
                out.data_ptr(),
                rows,
                n,
                k,
                torch.get_num_threads(),
            )
        return out


def load_pair_linear(allow_amx: bool = True) -> PairLinear:
    """Build (or find in the cache) and load the kernel: on AMX tiles where they run (and
    `allow_amx`), else on AVX-512 BF16; KernelBuildError where neither can run."""
    with _lock:
        if allow_amx not in _functions:
            library, engine = load_engine("pair_linear.c", {}, "duoserve_pair_linear_uses_amx", allow_amx)
            loaded = library.duoserve_pair_linear
            loaded.restype = None
            loaded.argtypes = _ARGTYPES
            _functions[allow_amx] = (loaded, engine)
        function, engine = _functions[allow_amx]
        return PairLinear(function, engine)


__all__ = ["MAX_ROWS", "KernelBuildError", "PairLinear", "load_pair_linear", "pack"]

"""y = x @ weight.T (+ bias) in bfloat16 on weights packed in pairs: decode-sized batches (1 to
MAX_ROWS rows) on AMX tiles, batches of any size on AVX-512 BF16 dot products.

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
With AMX the worker sends batches past MAX_ROWS to oneDNN, which is as fast or faster there on
prefill chunks; the dot products take prefill chunks too (gpu_worker/linear.py's
pair_takes_every_step), and on them a gate_up weight's product can end in the MLP's SiLU and
multiply (`PairLinear.silu_and_mul`). Where the CPU has neither engine, `load_pair_linear` raises
`KernelBuildError` and oneDNN takes every batch.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch

from kernels._launch import require
from kernels.cpu_build import KernelBuildError, load_engine

MAX_ROWS = 64  # with AMX the worker takes oneDNN past this

_lock = threading.Lock()
# By allow_amx: the product, the gate_up product with SiLU-and-multiply (dot engine only), the engine.
_functions: dict[bool, tuple[Callable[..., None], Callable[..., None] | None, str]] = {}

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
# duoserve_pair_linear_silu(x, x_stride, packed gate_up weight, y, rows, ffn, k, threads): no bias
_SILU_ARGTYPES: list[Any] = _ARGTYPES[:3] + _ARGTYPES[4:]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] → the pair layout [n / 16, k / 32, 16, 16, 2]: for each 16 outputs, their
    inputs in steps of 32, each step 16 rows of (output, input pair)."""
    require(PairLinear.supports(weight), "weight", weight, "a contiguous bfloat16 [n, k], k in 32s, n in 16s")
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


class PairLinear:
    """The loaded kernel; call it with x and a weight from `pack`."""

    def __init__(
        self, function: Callable[..., None], engine: str, silu_function: Callable[..., None] | None = None
    ) -> None:
        self._function = function
        self._silu_function = silu_function
        self.engine = engine  # what multiplies: cpu_build.AMX or cpu_build.BF16_DOT

    @property
    def fuses_silu(self) -> bool:
        """True where `silu_and_mul` runs (the dot-product engine)."""
        return self._silu_function is not None

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

    @staticmethod
    def _check(x: torch.Tensor, packed: torch.Tensor) -> None:
        require(
            x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(1) == 1,
            "x",
            x,
            "a bfloat16 [rows, in] CPU tensor with contiguous rows",
        )
        k = x.shape[1]
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

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._check(x, packed)
        rows, k = x.shape
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

    def silu_and_mul(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:  # [rows, ffn]
        """SiLU(x @ gate.T) * (x @ up.T) for `packed` a gate_up weight [2 ffn, in] (gate's rows, then
        up's) from `pack`: the bits of this product followed by the C SiLU-and-multiply
        (kernels/cpu_fused.py), without writing the [rows, 2 ffn] product. Dot engine only."""
        if self._silu_function is None:
            raise ValueError(f"the pair kernel on {self.engine} has no SiLU epilogue (`fuses_silu`)")
        self._check(x, packed)
        require(
            packed.shape[0] % 2 == 0, "packed", packed, "a gate_up weight: gate's and up's strips, as many"
        )
        rows, k = x.shape
        ffn = packed.shape[0] * 8
        out = torch.empty(rows, ffn, dtype=torch.bfloat16)
        if rows:
            self._silu_function(
                x.data_ptr(),
                x.stride(0),
                packed.data_ptr(),
                out.data_ptr(),
                rows,
                ffn,
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
            silu = getattr(library, "duoserve_pair_linear_silu", None)  # the dot engine's
            if silu is not None:
                silu.restype = None
                silu.argtypes = _SILU_ARGTYPES
            _functions[allow_amx] = (loaded, silu, engine)
        function, silu, engine = _functions[allow_amx]
        return PairLinear(function, engine, silu)


__all__ = ["MAX_ROWS", "KernelBuildError", "PairLinear", "load_pair_linear", "pack"]

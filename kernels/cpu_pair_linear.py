"""y = x @ weight.T (+ bias) in bfloat16 on weights packed in pairs, for decode-sized batches (1
to MAX_ROWS rows).

A decode step's linears stream every weight once and do little with it. oneDNN's packed kernel
(gpu_worker/linear.py) is tuned for large batches; `kernels/cpu/pair_linear.c` packs each weight
once into bfloat16 pairs (one contiguous strip of the input dimension per 16 outputs), the
layout that both AMX tiles and AVX-512 BF16 dot products take, and streams the strips. It is
built with one of two engines: AMX tiles where the CPU has AMX-BF16 and Linux grants the tile
state, else AVX-512 BF16 dot products. Measured over the four linears of SmolLM2's 30 layers,
weights from memory:
- AMX, on a 2-core Intel Xeon: 5.9 ms at two rows (the small-batch kernel: 8.1), 8.4 at 16
  (oneDNN: 12.0), 15.5 at 64 (oneDNN: 16.8);
- dot products, on a 2-core AMD EPYC: 6.4 ms at one or two rows (the small-batch kernel:
  7.4-8.0), 10.9 at 16 (oneDNN: 14.2), 33.0 at 64 (oneDNN: 38.3-49.8), 65 at 128 (oneDNN: 75).
The worker sends batches past MAX_ROWS to oneDNN, which is as fast or faster on prefill chunks.
Where the CPU has neither engine, `load_pair_linear` raises `KernelBuildError` and the worker
keeps the other kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kernels._launch import require
from kernels.cpu_build import KernelBuildError, load_engine
from kernels.cpu_linear import LINEAR_ARGTYPES, check_bias, check_input, run_linear

MAX_ROWS = 64  # the worker takes oneDNN past this

_lock = threading.Lock()
_functions: dict[bool, tuple[Callable[..., None], str]] = {}


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
            f"a weight of input size {k} from kernels.cpu_pair_linear.pack",
        )
        n = packed.shape[0] * 16
        check_bias(bias, n)
        return run_linear(self._function, x, packed, bias, n)


def load_pair_linear(allow_amx: bool = True) -> PairLinear:
    """Build (or find in the cache) and load the kernel: on AMX tiles where they run (and
    `allow_amx`), else on AVX-512 BF16; KernelBuildError where neither can run."""
    with _lock:
        if allow_amx not in _functions:
            library, engine = load_engine("pair_linear.c", {}, "duoserve_pair_linear_uses_amx", allow_amx)
            loaded = library.duoserve_pair_linear
            loaded.restype = None
            loaded.argtypes = LINEAR_ARGTYPES
            _functions[allow_amx] = (loaded, engine)
        function, engine = _functions[allow_amx]
        return PairLinear(function, engine)


__all__ = ["MAX_ROWS", "KernelBuildError", "PairLinear", "load_pair_linear", "pack"]

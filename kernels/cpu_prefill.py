"""Causal attention of whole prompts on AMX tiles (`kernels/cpu/amx_prefill_attention.c`).

A prefill chunk that starts its sequence attends only to itself, causally. torch's CPU flash
kernel does that at about 100 GFLOP/s on SmolLM2's shapes (head_dim 64, 3 query heads per kv
head); this kernel multiplies on AMX tiles and takes an exact softmax per row, for any mix of
prompt lengths in one call. It is built per head_dim (32 or 64) where the CPU has AMX-BF16 and
Linux grants the tile state; elsewhere `load_amx_prefill_attention` raises `KernelBuildError`
and the worker keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernels._launch import require
from kernels.cpu_build import KernelBuildError, build, load

HEAD_DIMS = (32, 64)

_lock = threading.Lock()
_functions: dict[int, Callable[..., int]] = {}

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_ARGTYPES: list[Any] = [
    _P,
    _I64,
    _P,
    _I64,
    _P,
    _I64,
    _P,
    _I64,
    _P,
    _P,
    _I64,
    _I64,
    _I64,
    ctypes.c_float,
    ctypes.c_int,
]


def _rows_of_heads(tensor: torch.Tensor, name: str, heads: int, head_dim: int) -> None:
    """[T, heads, head_dim] bfloat16 on the CPU, heads packed within a row, rows at any stride."""
    require(
        tensor.dim() == 3
        and tensor.shape[1:] == (heads, head_dim)
        and tensor.dtype == torch.bfloat16
        and tensor.device.type == "cpu"
        and tensor.stride(2) == 1
        and tensor.stride(1) == head_dim
        and tensor.stride(0) >= heads * head_dim,
        name,
        tensor,
        f"[T, {heads}, {head_dim}] bfloat16 on the CPU with heads packed in each row",
    )


class AmxPrefillAttention:
    """The loaded kernel for one head_dim; call it per layer."""

    def __init__(self, function: Callable[..., int], head_dim: int) -> None:
        self._function = function
        self.head_dim = head_dim

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, Hkv, Dh]
        v: torch.Tensor,  # [T, Hkv, Dh]
        prompts: Sequence[tuple[int, int]],  # (first row, length) of each whole prompt
        out: torch.Tensor,  # [T, H, Dh], contiguous heads; only the prompts' rows are written
    ) -> torch.Tensor:
        """Causal attention within each prompt's rows; returns `out`."""
        tokens, heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
        require(head_dim == self.head_dim, "q", q, f"[T, H, {self.head_dim}]")
        _rows_of_heads(q, "q", heads, head_dim)
        kv_heads = k.shape[1] if k.dim() == 3 else 0
        require(
            kv_heads > 0 and heads % kv_heads == 0, "k", k, f"[T, Hkv, {head_dim}] with Hkv dividing {heads}"
        )
        for name, tensor in (("k", k), ("v", v)):
            _rows_of_heads(tensor, name, kv_heads, head_dim)
            require(tensor.shape[0] == tokens, name, tensor, f"{tokens} rows, like q")
        _rows_of_heads(out, "out", heads, head_dim)
        require(out.shape[0] == tokens, "out", out, f"{tokens} rows, like q")
        for start, length in prompts:
            if length < 1 or start < 0 or start + length > tokens:
                raise ValueError(
                    f"prompts: ({start}, {length}) is not a non-empty run of rows in 0..{tokens}"
                )
        if not prompts:
            return out
        starts = torch.tensor([start for start, _ in prompts], dtype=torch.int64)
        lens = torch.tensor([length for _, length in prompts], dtype=torch.int64)
        status = self._function(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            out.data_ptr(),
            out.stride(0),
            starts.data_ptr(),
            lens.data_ptr(),
            len(prompts),
            heads,
            kv_heads,
            1.0 / math.sqrt(head_dim),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("AMX prefill attention: its workspace could not be allocated")
        return out


def load_amx_prefill_attention(head_dim: int) -> AmxPrefillAttention:
    """Build (or find in the cache) and load the kernel for head_dim; KernelBuildError where it
    cannot run."""
    if head_dim not in HEAD_DIMS:
        raise KernelBuildError(f"the AMX prefill attention takes head_dim {HEAD_DIMS}, not {head_dim}")
    with _lock:
        if head_dim not in _functions:
            library = load(build("amx_prefill_attention.c", {"HEAD_DIM": head_dim}))
            if library.duoserve_amx_init() != 0:
                raise KernelBuildError("the Linux kernel did not grant this process the AMX tile state")
            function = library.duoserve_amx_causal_attention
            function.restype = ctypes.c_int
            function.argtypes = _ARGTYPES
            _functions[head_dim] = function
        return AmxPrefillAttention(_functions[head_dim], head_dim)


__all__ = ["HEAD_DIMS", "AmxPrefillAttention", "KernelBuildError", "load_amx_prefill_attention"]

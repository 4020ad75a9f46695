"""Prefill attention on AMX tiles (`kernels/cpu/amx_prefill_attention.c`).

Each prefill chunk's queries attend causally to the chunk and to all of its sequence's cached
prefix. torch's CPU flash kernel reaches about 100 GFLOP/s on SmolLM2's shapes (head_dim 64, 3
query heads per kv head), and a chunk behind a prefix first gathers that prefix and takes the
masked path; this kernel multiplies on AMX tiles, reads the prefix from the paged cache through
its slots, and takes an exact softmax per row, for any mix of chunks in one call. It is built per
head_dim (32 or 64) where the CPU has AMX-BF16 and Linux grants the tile state; elsewhere
`load_amx_prefill_attention` raises `KernelBuildError` and the worker keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    *(_P, _I64) * 3,  # q, k, v and their row strides
    *(_P, _P, _I64),  # k_cache, v_cache, their row stride
    *(_P, _I64),  # out, its row stride
    *(_P,) * 5,  # starts, lens, prefixes, slot_starts, slots
    *(_I64,) * 3,  # chunks, heads, kv heads
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


@dataclass(frozen=True, slots=True)
class Chunk:
    """One prefill chunk of a step: query rows [start, start + length); with `key_slots`, it sits
    behind a cached prefix and its keys and values (the prefix's and its own, already written)
    are read from the cache at those slots, one per position."""

    start: int
    length: int
    key_slots: torch.Tensor | None = None  # [prefix + length] int64


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
        chunks: Sequence[Chunk],
        out: torch.Tensor,  # [T, H, Dh], contiguous heads; only the chunks' rows are written
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,  # [blocks, block_size, Hkv, Dh] each
    ) -> torch.Tensor:
        """Each chunk's queries attend causally to the chunk and to its prefix; returns `out`."""
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
        for chunk in chunks:
            if chunk.length < 1 or chunk.start < 0 or chunk.start + chunk.length > tokens:
                raise ValueError(
                    f"chunks: ({chunk.start}, {chunk.length}) is not a non-empty run of rows in 0..{tokens}"
                )
        if not chunks:
            return out
        prefixed = [chunk for chunk in chunks if chunk.key_slots is not None]
        k_cache = v_cache = out  # any valid pointer when no chunk reads the cache
        slots = torch.zeros(1, dtype=torch.int64)
        if prefixed:
            if kv_cache is None:
                raise ValueError("kv_cache: chunks behind a cached prefix read it, but none was given")
            k_cache, v_cache = kv_cache
            for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                require(
                    cache.dim() == 4
                    and cache.shape[2:] == (kv_heads, head_dim)
                    and cache.dtype == torch.bfloat16
                    and cache.device.type == "cpu"
                    and cache.is_contiguous(),
                    name,
                    cache,
                    f"contiguous [blocks, block_size, {kv_heads}, {head_dim}] bfloat16 on the CPU",
                )
            require(v_cache.shape == k_cache.shape, "v_cache", v_cache, f"shape {tuple(k_cache.shape)}")
            num_slots = k_cache.shape[0] * k_cache.shape[1]
            for chunk in prefixed:
                key_slots = chunk.key_slots
                assert key_slots is not None
                require(
                    key_slots.dim() == 1
                    and key_slots.dtype == torch.int64
                    and key_slots.shape[0] > chunk.length
                    and int(key_slots.min()) >= 0
                    and int(key_slots.max()) < num_slots,
                    "key_slots",
                    key_slots,
                    f"[prefix + {chunk.length}] int64 slots in 0..{num_slots - 1}, prefix >= 1",
                )
            slots = torch.cat([chunk.key_slots for chunk in prefixed if chunk.key_slots is not None])
        prefixes = [
            0 if chunk.key_slots is None else chunk.key_slots.shape[0] - chunk.length for chunk in chunks
        ]
        slot_starts, at = [], 0
        for chunk in chunks:
            slot_starts.append(at)
            at += 0 if chunk.key_slots is None else chunk.key_slots.shape[0]
        table = torch.tensor(
            [[c.start for c in chunks], [c.length for c in chunks], prefixes, slot_starts], dtype=torch.int64
        )
        status = self._function(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_heads * head_dim,
            out.data_ptr(),
            out.stride(0),
            table[0].data_ptr(),
            table[1].data_ptr(),
            table[2].data_ptr(),
            table[3].data_ptr(),
            slots.data_ptr(),
            len(chunks),
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
            function = library.duoserve_amx_prefill_attention
            function.restype = ctypes.c_int
            function.argtypes = _ARGTYPES
            _functions[head_dim] = function
        return AmxPrefillAttention(_functions[head_dim], head_dim)


__all__ = ["HEAD_DIMS", "AmxPrefillAttention", "Chunk", "KernelBuildError", "load_amx_prefill_attention"]

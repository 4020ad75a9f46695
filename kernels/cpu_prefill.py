"""Prefill attention on the CPU, one C call per layer for all of a step's chunks.

Each prefill chunk's queries attend causally to the chunk and to all of its sequence's cached
prefix. torch's CPU flash kernel reaches about 100 GFLOP/s on SmolLM2's shapes (head_dim 64, 3
query heads per kv head) with AVX-512 and 46-76 on a 2-core AVX2 EPYC, and a chunk behind a
prefix first gathers that prefix and takes the masked path. These kernels read the prefix from
the paged cache through its slots and take any mix of chunks in one call:
- bfloat16 (`kernels/cpu/prefill_attention.c`): multiplies bfloat16 pairs into float32 and takes
  an exact softmax per row, built per head_dim (32 or 64) with one of two engines, AMX tiles
  where the CPU has AMX-BF16 and Linux grants the tile state, else AVX-512 BF16 dot products;
- float32 (`kernels/cpu/prefill_attention_f32.c`): AVX2 and FMA register tiles with an online
  softmax over blocks of keys, per head_dim 32, 64 or 128.
Where the CPU cannot run the dtype's kernel, `load_prefill_attention` raises `KernelBuildError`
and the worker keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels._launch import dtype_name, require
from kernels.cpu_build import SOURCES, KernelBuildError, build, cpu_has, load, load_engine

HEAD_DIMS = {torch.bfloat16: (32, 64), torch.float32: (32, 64, 128)}
AVX2_FMA = "avx2_fma"  # the float32 kernel's engine

_lock = threading.Lock()
_functions: dict[tuple[int, bool, torch.dtype, Path], tuple[Callable[..., int], str]] = {}

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


def _rows_of_heads(tensor: torch.Tensor, name: str, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """[T, heads, head_dim] of `dtype` on the CPU, heads packed within a row, rows at any stride."""
    require(
        tensor.dim() == 3
        and tensor.shape[1:] == (heads, head_dim)
        and tensor.dtype == dtype
        and tensor.device.type == "cpu"
        and tensor.stride(2) == 1
        and tensor.stride(1) == head_dim
        and tensor.stride(0) >= heads * head_dim,
        name,
        tensor,
        f"[T, {heads}, {head_dim}] {dtype_name(dtype)} on the CPU with heads packed in each row",
    )


@dataclass(frozen=True, slots=True)
class Chunk:
    """One prefill chunk of a step: query rows [start, start + length); with `key_slots`, it sits
    behind a cached prefix and its keys and values (the prefix's and its own, already written)
    are read from the cache at those slots, one per position."""

    start: int
    length: int
    key_slots: torch.Tensor | None = None  # [prefix + length] int64


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """A step's chunks, checked and laid out for the kernel once: every layer reuses it."""

    num_chunks: int
    rows: int  # the chunks cover rows below this
    table: torch.Tensor  # [4, chunks] int64: first row, length, prefix, first slot in `slots`
    slots: torch.Tensor  # the prefixed chunks' key slots, back to back ([1] zero when none)
    max_slot: int  # -1 when no chunk reads the cache


def plan_chunks(chunks: Sequence[Chunk]) -> PrefillPlan:
    """Check `chunks` and lay them out for the kernel (ValueError naming what is wrong)."""
    prefixes, slot_starts, at, rows, max_slot = [], [], 0, 0, -1
    for chunk in chunks:
        if chunk.length < 1 or chunk.start < 0:
            raise ValueError(f"chunks: ({chunk.start}, {chunk.length}) is not a non-empty run of rows")
        rows = max(rows, chunk.start + chunk.length)
        slot_starts.append(at)
        key_slots = chunk.key_slots
        if key_slots is None:
            prefixes.append(0)
            continue
        require(
            key_slots.dim() == 1
            and key_slots.dtype == torch.int64
            and key_slots.device.type == "cpu"
            and key_slots.shape[0] > chunk.length
            and int(key_slots.min()) >= 0,
            "key_slots",
            key_slots,
            f"[prefix + {chunk.length}] int64 slots >= 0 on the CPU, prefix >= 1",
        )
        prefixes.append(key_slots.shape[0] - chunk.length)
        max_slot = max(max_slot, int(key_slots.max()))
        at += key_slots.shape[0]
    prefixed = [chunk.key_slots for chunk in chunks if chunk.key_slots is not None]
    table = torch.tensor(
        [[c.start for c in chunks], [c.length for c in chunks], prefixes, slot_starts], dtype=torch.int64
    )
    slots = torch.cat(prefixed) if prefixed else torch.zeros(1, dtype=torch.int64)
    return PrefillPlan(len(chunks), rows, table, slots, max_slot)


class CpuPrefillAttention:
    """The loaded kernel for one head_dim and dtype; call it per layer with the step's `plan_chunks`.
    `engine` says what multiplies: cpu_build.AMX (tiles) or cpu_build.BF16_DOT (dot products) in
    bfloat16, AVX2_FMA in float32."""

    def __init__(self, function: Callable[..., int], head_dim: int, engine: str, dtype: torch.dtype) -> None:
        self._function = function
        self.head_dim = head_dim
        self.engine = engine
        self.dtype = dtype

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, Hkv, Dh]
        v: torch.Tensor,  # [T, Hkv, Dh]
        plan: PrefillPlan,
        out: torch.Tensor,  # [T, H, Dh], contiguous heads; only the chunks' rows are written
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,  # [blocks, block_size, Hkv, Dh] each
    ) -> torch.Tensor:
        """Each chunk's queries attend causally to the chunk and to its prefix; returns `out`."""
        tokens, heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
        require(head_dim == self.head_dim, "q", q, f"[T, H, {self.head_dim}]")
        _rows_of_heads(q, "q", heads, head_dim, self.dtype)
        kv_heads = k.shape[1] if k.dim() == 3 else 0
        require(
            kv_heads > 0 and heads % kv_heads == 0, "k", k, f"[T, Hkv, {head_dim}] with Hkv dividing {heads}"
        )
        for name, tensor in (("k", k), ("v", v)):
            _rows_of_heads(tensor, name, kv_heads, head_dim, self.dtype)
            require(tensor.shape[0] == tokens, name, tensor, f"{tokens} rows, like q")
        _rows_of_heads(out, "out", heads, head_dim, self.dtype)
        require(out.shape[0] == tokens, "out", out, f"{tokens} rows, like q")
        if plan.rows > tokens:
            raise ValueError(f"plan: its chunks reach row {plan.rows}, but q has {tokens} rows")
        if not plan.num_chunks:
            return out
        k_cache = v_cache = out  # any valid pointer when no chunk reads the cache
        if plan.max_slot >= 0:
            if kv_cache is None:
                raise ValueError("kv_cache: chunks behind a cached prefix read it, but none was given")
            k_cache, v_cache = kv_cache
            for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                require(
                    cache.dim() == 4
                    and cache.shape[2:] == (kv_heads, head_dim)
                    and cache.dtype == self.dtype
                    and cache.device.type == "cpu"
                    and cache.is_contiguous(),
                    name,
                    cache,
                    f"contiguous [blocks, block_size, {kv_heads}, {head_dim}] "
                    f"{dtype_name(self.dtype)} on the CPU",
                )
            require(v_cache.shape == k_cache.shape, "v_cache", v_cache, f"shape {tuple(k_cache.shape)}")
            num_slots = k_cache.shape[0] * k_cache.shape[1]
            if plan.max_slot >= num_slots:
                raise ValueError(f"key_slots: slots must be < {num_slots}, got {plan.max_slot}")
        table = plan.table
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
            plan.slots.data_ptr(),
            plan.num_chunks,
            heads,
            kv_heads,
            1.0 / math.sqrt(head_dim),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("prefill attention: its workspace could not be allocated")
        return out


def load_prefill_attention(
    head_dim: int, allow_amx: bool = True, dtype: torch.dtype = torch.bfloat16, sources: Path = SOURCES
) -> CpuPrefillAttention:
    """Build (or find in the cache) and load the kernel for head_dim and dtype. bfloat16: on AMX
    tiles where they run (and `allow_amx`), else on AVX-512 BF16; float32: on AVX2 and FMA.
    KernelBuildError where the CPU cannot run it. `sources`: the kernel sources' folder (another
    revision's, for a benchmark's A/B)."""
    if dtype not in HEAD_DIMS:
        raise KernelBuildError(f"the CPU prefill attention takes bfloat16 or float32, not {dtype}")
    if head_dim not in HEAD_DIMS[dtype]:
        raise KernelBuildError(
            f"the CPU prefill attention takes head_dim {HEAD_DIMS[dtype]} in {dtype}, not {head_dim}"
        )
    if dtype == torch.float32 and not (cpu_has("avx2") and cpu_has("fma")):
        raise KernelBuildError("the float32 prefill attention needs AVX2 and FMA")
    with _lock:
        key = (head_dim, allow_amx and dtype == torch.bfloat16, dtype, sources)  # AMX is a bfloat16 engine
        if key not in _functions:
            if dtype == torch.float32:
                library = load(build("prefill_attention_f32.c", {"HEAD_DIM": head_dim}, sources))
                engine = AVX2_FMA
            else:
                library, engine = load_engine(
                    "prefill_attention.c",
                    {"HEAD_DIM": head_dim},
                    "duoserve_prefill_attention_uses_amx",
                    allow_amx,
                    sources,
                )
            loaded = library.duoserve_prefill_attention
            loaded.restype = ctypes.c_int
            loaded.argtypes = _ARGTYPES
            _functions[key] = (loaded, engine)
        function, engine = _functions[key]
        return CpuPrefillAttention(function, head_dim, engine, dtype)


__all__ = [
    "AVX2_FMA",
    "HEAD_DIMS",
    "Chunk",
    "CpuPrefillAttention",
    "KernelBuildError",
    "PrefillPlan",
    "load_prefill_attention",
    "plan_chunks",
]

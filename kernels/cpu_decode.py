"""Paged decode attention on the CPU: a small C kernel, built on first use, and its torch reference.

The kernel (`kernels/cpu/paged_decode_attention.c`) reads keys and values in place from the
paged cache, so a decode step no longer copies every sequence's context into a padded buffer
before attending. It is compiled once per model shape (kernels/cpu_build.py). No compiler means
no kernel: `load_cpu_decode_attention` raises `KernelBuildError` and the worker keeps the torch
path.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kernels._launch import require, require_contiguous
from kernels.cpu_build import KernelBuildError, build, load
from kernels.kv_int8 import Int8Cache, dequantize, int8_pair

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256  # multiples of 8 up to this
MAX_BLOCK_SIZE = 64
MAX_GROUP = 16
DTYPES = (torch.float32, torch.bfloat16)

VECTOR_PATHS = {512: "AVX-512", 256: "AVX2", 0: "plain C"}  # the kernel's intrinsics paths, by vector bits
VECTOR_BITS = tuple(VECTOR_PATHS)

_lock = threading.Lock()
_loaded: dict[tuple[int, int, int, torch.dtype, int, bool], CpuDecodeAttention] = {}


@dataclass(frozen=True, slots=True)
class _Shape:
    head_dim: int
    group: int  # query heads per KV head
    block_size: int
    dtype: torch.dtype
    kv_int8: bool = False  # the cache holds int8 rows and their scales (kernels/kv_int8.py)


class CpuDecodeAttention:
    """The loaded kernel for one (head_dim, group, block_size, dtype, cache kind); call it per layer."""

    def __init__(
        self, function: Callable[..., None], shape: _Shape, library_path: Path, vector_path: int
    ) -> None:
        self._function = function
        self.shape = shape
        self.library_path = library_path
        self.vector_path = vector_path  # the intrinsics its build takes: 512 (AVX-512), 256 (AVX2), 0 (none)

    def __call__(
        self,
        q: torch.Tensor,  # [N, H, Dh]
        k_cache: torch.Tensor | Int8Cache,  # [num_blocks, block_size, Hkv, Dh]
        v_cache: torch.Tensor | Int8Cache,
        block_tables: torch.Tensor,  # [N, max_blocks] int32
        context_lens: torch.Tensor,  # [N] int32, each in [1, max_blocks * block_size]
        out: torch.Tensor | None = None,  # [N, H, Dh], like q
    ) -> torch.Tensor:
        """Attend each sequence's one query token to its first context_lens[n] cached tokens.

        Shapes, dtypes and strides are checked here; block ids and context lengths are trusted
        (check them once per batch with `check_block_tables`), since the kernel reads the cache
        at whatever they say.
        """
        shape = self.shape
        require(q.dim() == 3 and q.is_contiguous(), "q", q, "a contiguous [N, H, head_dim] tensor")
        num_seqs, num_heads, head_dim = q.shape
        scales: tuple[int, int] = (0, 0)
        if shape.kv_int8:
            k_cache, v_cache = int8_pair(k_cache, v_cache)
            scales = (k_cache.scales.data_ptr(), v_cache.scales.data_ptr())
            k_cache, v_cache = k_cache.values, v_cache.values
        elif isinstance(k_cache, Int8Cache) or isinstance(v_cache, Int8Cache):
            raise ValueError("k_cache: an int8 cache needs the kernel built for one (kv_int8=True)")
        assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
        require(k_cache.dim() == 4 and k_cache.is_contiguous(), "k_cache", k_cache, "contiguous 4-D")
        require(
            v_cache.shape == k_cache.shape and v_cache.is_contiguous(), "v_cache", v_cache, "like k_cache"
        )
        _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
        require(head_dim == shape.head_dim == cache_head_dim, "head_dim", q, f"{shape.head_dim}")
        require(block_size == shape.block_size, "block_size", k_cache, f"{shape.block_size}")
        require(num_heads == num_kv_heads * shape.group, "num_heads", q, f"{num_kv_heads} * {shape.group}")
        cache_dtype = torch.int8 if shape.kv_int8 else shape.dtype
        for name, tensor, dtype in (
            ("q", q, shape.dtype),
            ("k_cache", k_cache, cache_dtype),
            ("v_cache", v_cache, cache_dtype),
        ):
            require(tensor.dtype == dtype and tensor.device.type == "cpu", name, tensor, f"{dtype} on cpu")
        require_contiguous(block_tables, "block_tables", (num_seqs, "max_blocks"), torch.int32)
        require_contiguous(context_lens, "context_lens", (num_seqs,), torch.int32)
        if out is None:
            out = torch.empty_like(q)
        require(out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous(), "out", out, "like q")
        if num_seqs:
            self._function(
                q.data_ptr(),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                *scales,
                block_tables.data_ptr(),
                context_lens.data_ptr(),
                out.data_ptr(),
                num_seqs,
                num_kv_heads,
                block_tables.shape[1],
                head_dim**-0.5,
                torch.get_num_threads(),
            )
        return out


def check_block_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Raise ValueError unless every context is in [1, table width * block_size] and every used id < num_blocks.
    Once per step on the worker's critical path: numpy on the CPU tensors' memory, a few
    microseconds, where the same checks as torch ops took about 50."""
    if context_lens.numel() == 0:
        return
    lens = context_lens.cpu().numpy().astype(np.int64)
    width = block_tables.shape[1]
    if lens.min() < 1 or lens.max() > width * block_size:
        raise ValueError(
            f"context_lens must be in [1, {width * block_size}], got [{lens.min()}, {lens.max()}]"
        )
    used = np.arange(width) < ((lens + block_size - 1) // block_size)[:, None]
    ids = block_tables.cpu().numpy()[used]
    if ids.min() < 0 or ids.max() >= num_blocks:
        raise ValueError(f"block ids must be in [0, {num_blocks}), got [{ids.min()}, {ids.max()}]")


def gather_context(
    k_cache: torch.Tensor | Int8Cache,
    v_cache: torch.Tensor | Int8Cache,
    table: torch.Tensor,
    length: int,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # each [length, num_heads, head_dim] float32
    """A sequence's first `length` keys and values from the paged caches, one copy per query head
    (an int8 cache's rows times their scales)."""
    if isinstance(k_cache, Int8Cache):
        k_cache = dequantize(k_cache, torch.float32)
    if isinstance(v_cache, Int8Cache):
        v_cache = dequantize(v_cache, torch.float32)
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    blocks = table[: -(-length // block_size)].long()
    group = num_heads // num_kv_heads
    keys = (
        k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float().repeat_interleave(group, dim=1)
    )
    values = (
        v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float().repeat_interleave(group, dim=1)
    )
    return keys, values


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor | Int8Cache,
    v_cache: torch.Tensor | Int8Cache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """The definition the kernel is tested against: per sequence, gather its keys and values, softmax in float32."""
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    for n in range(num_seqs):
        keys, values = gather_context(k_cache, v_cache, block_tables[n], int(context_lens[n]), num_heads)
        scores = torch.einsum("hd,lhd->hl", q[n].float(), keys) * head_dim**-0.5
        out[n] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values).to(q.dtype)
    return out


def build_cpu_decode_attention(
    head_dim: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    vector_bits: int = 512,
    kv_int8: bool = False,
) -> Path:
    """The kernel's library for this shape, compiled unless it is in the cache, not loaded;
    KernelBuildError if impossible. Builds of different shapes may run on threads side by side.
    The arguments as load_cpu_decode_attention's."""
    supported = (
        8 <= head_dim <= MAX_HEAD_DIM
        and head_dim % 8 == 0
        and 1 <= block_size <= MAX_BLOCK_SIZE
        and 1 <= group <= MAX_GROUP
    )
    if not supported:
        raise KernelBuildError(
            f"no CPU decode kernel for head_dim={head_dim} (multiples of 8 up to {MAX_HEAD_DIM}), "
            f"group={group} (1..{MAX_GROUP}), block_size={block_size} (1..{MAX_BLOCK_SIZE})"
        )
    if dtype not in DTYPES:
        raise KernelBuildError(f"no CPU decode kernel for {dtype}; supported: {DTYPES}")
    if vector_bits not in VECTOR_BITS:
        raise KernelBuildError(f"vector_bits={vector_bits}; supported: {VECTOR_BITS}")
    return build(
        "paged_decode_attention.c",
        {
            "HEAD_DIM": head_dim,
            "GROUP": group,
            "BLOCK": block_size,
            "ELEM_BF16": int(dtype == torch.bfloat16),
            "VECTOR_BITS": vector_bits,
            "KV_INT8": int(kv_int8),
        },
    )


def load_cpu_decode_attention(
    head_dim: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    vector_bits: int = 512,
    kv_int8: bool = False,
) -> CpuDecodeAttention:
    """Build (or find in the cache) and load the kernel for this shape; KernelBuildError if impossible.
    `vector_bits` caps its intrinsics path at AVX-512 (512: the widest this CPU has), AVX2 (256) or
    none (0), so the tests can run each path a CPU may take. `kv_int8`: for an int8 cache (kernels/kv_int8.py)."""
    key = (head_dim, group, block_size, dtype, vector_bits, kv_int8)
    with _lock:
        if key not in _loaded:
            path = build_cpu_decode_attention(head_dim, group, block_size, dtype, vector_bits, kv_int8)
            function, vector_path = _bind(path)
            shape = _Shape(head_dim, group, block_size, dtype, kv_int8)
            _loaded[key] = CpuDecodeAttention(function, shape, path, vector_path)
        return _loaded[key]


def _bind(path: Path) -> tuple[Callable[..., None], int]:
    """The library's attention function and the vector path its build took."""
    library = load(path)
    function = library.duoserve_paged_decode_attention
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int]
    vector_path = library.duoserve_paged_decode_vector_path
    vector_path.restype = ctypes.c_int
    vector_path.argtypes = []
    return function, int(vector_path())

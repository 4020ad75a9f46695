"""y = x @ weight.T (+ bias) in float32 on a weight kept as its file stores it, on the CPU, for decode
steps and prefill chunks: a GGUF file's blocks (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, IQ4_NL, the 4-bit
floats MXFP4 and NVFP4 (blocks of 64), and the super-blocks of 256 weights of the K-quants Q2_K to
Q6_K, of IQ4_XS, of the codebook types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S and
of the ternary TQ1_0 and TQ2_0), or 16-bit floats (F16, BF16) of a GGUF file or a safetensors
checkpoint, in 32-weight "blocks" of their own: the weights of kernels/block_weights.py.

A decode step of a few sequences streams every weight from memory once, so its linears take as
long as the weights' bytes take to arrive. `kernels/cpu/block_linear.c` reads the file's own 4-
and 8-bit blocks and widens them to float32 in registers: SmolLM2-135M's linears and head are
96 MB that way against 538 MB in float32. Past a few rows the multiplies set the time; the kernel
then widens panels of weight rows into cache and multiplies in register tiles, faster than
oneDNN's packed float32 kernel up to about MAX_ROWS rows (bench/linear_ab.py). The products are
those of the dequantized weight (the additions in another order), so the result matches
x @ dequantize(weight).T to float32 rounding. AVX2, FMA and F16C
are needed; elsewhere `load_block_linear` raises `KernelBuildError` and the worker keeps its
float32 copies for every step.

bfloat16 x (and bias) give a bfloat16 y: each widened weight is rounded to bfloat16 (the value the
model's bfloat16 copy holds), the products and sums are float32 on the widened x, and y is rounded
once. That is how bfloat16 models run on CPUs that cannot multiply bfloat16 (no AVX-512 BF16, no
AMX), where torch's bfloat16 matmul is 4-5x slower than this kernel on SmolLM2's shapes. A
bfloat16 weight multiplies on itself (`BlockWeight.dense`, no copy).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from kernels._launch import dtype_name, require
from kernels.block_weights import BlockRows, Blocks, BlockWeight
from kernels.cpu_build import SOURCES, KernelBuildError, build, cpu_has, load, splits_512_bit_operations

MAX_ROWS = 256  # in float32 the worker takes oneDNN past this, past 64 with AVX-512 (gpu_worker/linear.py)
DTYPES = (torch.float32, torch.bfloat16)  # of x, the bias and y
STREAM_ROWS = 6  # block_linear.c's: up to this many rows of x stream each weight row once
DOT_ROWS_WITH_AMX = 2  # see dot_rows


class CodebookTables(NamedTuple):
    """ggml's codebooks as the gguf package holds them, as bytes, in the order
    duoserve_block_linear_use_codebooks takes them."""

    iq2_xxs: np.ndarray  # 256 rows of 8 unsigned values
    iq2_xs: np.ndarray  # 512 rows of 8
    iq2_s: np.ndarray  # 1024 rows of 8
    iq3_xxs: np.ndarray  # 256 rows of 4
    iq3_s: np.ndarray  # 512 rows of 4
    iq1: np.ndarray  # IQ1_S's and IQ1_M's 2048 rows of 8 of -1, 0 and 1, as 8 times those, signed
    signs: np.ndarray  # the 128 sign patterns of the IQ2 types and IQ3_XXS


@functools.cache
def codebook_tables() -> CodebookTables:
    """The codebooks, made once; the libraries hold pointers into them, which the cache keeps
    alive."""

    def grid(quant: Any) -> np.ndarray:
        quant.init_grid()
        assert quant.grid is not None
        return np.asarray(quant.grid, dtype=np.float32).reshape(quant.grid_shape)

    def unsigned(quant: Any) -> np.ndarray:
        values = grid(quant)
        rows = values.astype(np.uint8)
        assert np.array_equal(rows.astype(np.float32), values), f"{quant.__name__}'s grid is not bytes"
        return np.ascontiguousarray(rows)

    ternary = grid(gguf.quants.IQ1_S)
    assert np.isin(ternary, (-1.0, 0.0, 1.0)).all(), "IQ1_S's grid is not of -1, 0 and 1"
    signs = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()
    assert signs.shape == (128,)
    return CodebookTables(
        iq2_xxs=unsigned(gguf.quants.IQ2_XXS),
        iq2_xs=unsigned(gguf.quants.IQ2_XS),
        iq2_s=unsigned(gguf.quants.IQ2_S),
        iq3_xxs=unsigned(gguf.quants.IQ3_XXS),
        iq3_s=unsigned(gguf.quants.IQ3_S),
        iq1=np.ascontiguousarray((8 * ternary).astype(np.int8)),
        signs=signs,
    )


_lock = threading.Lock()
_loaded: dict[torch.dtype, ctypes.CDLL] = {}  # each element type's library, its own build

# duoserve_block_linear[_bf16](x, x_stride, w, type, bias, y, y_stride, rows, n, k, threads) -> 0 | -1 | -2
_ARGTYPES: list[Any] = [
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int,
]
# duoserve_block_dequantize(w, type, out, n, k, threads) -> 0 | -1 | -2
_DEQUANTIZE_ARGTYPES: list[Any] = [
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int,
]


class BlockLinear:
    """The loaded kernel; call it with float32 or bfloat16 x and a `BlockWeight` or `BlockRows`. The
    library of the other element type than the one loaded is built on its first call. With
    `library` (from `open_library`), x in that library's element type multiplies on it."""

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        self.library = library

    @property
    def dot_products(self) -> bool:
        """True where the bfloat16 build's streaming path (1-6 rows) multiplies on AVX-512 BF16 dot
        products, which makes the blocks faster than the pair-layout kernel at 1-4 rows (see
        gpu_worker/linear.py's SMALL_STEP_ROWS). Builds the bfloat16 library if it is not loaded."""
        library = self.library if self.library is not None else _library(torch.bfloat16)
        query = getattr(library, "duoserve_block_linear_bf16_dot_products", None)
        return query is not None and bool(query())

    def dot_rows(self, rows: int = -1) -> int:
        """The most rows of x the bfloat16 build multiplies on dot products (0 where it has none;
        open_library sets it from dot_rows()); with `rows` >= 0, first sets it to that (at most
        STREAM_ROWS), for the whole process."""
        library = self.library if self.library is not None else _library(torch.bfloat16)
        limit = getattr(library, "duoserve_block_linear_bf16_dot_rows", None)
        return 0 if limit is None else int(limit(rows))

    def __call__(self, x: torch.Tensor, weight: Blocks, bias: torch.Tensor | None = None) -> torch.Tensor:
        require(
            x.dim() == 2
            and x.dtype in DTYPES
            and x.device.type == "cpu"
            and x.stride(1) == 1
            and x.shape[1] == weight.k,
            "x",
            x,
            f"a float32 or bfloat16 [rows, {weight.k}] CPU tensor with contiguous rows",
        )
        if bias is not None:
            name = dtype_name(x.dtype)
            require(
                bias.shape == (weight.n,) and bias.dtype == x.dtype and bias.is_contiguous(),
                "bias",
                bias,
                f"a contiguous {name} [{weight.n}] tensor, as x is {name}",
            )
        out = torch.empty(x.shape[0], weight.n, dtype=x.dtype)
        if x.shape[0]:
            first = 0
            for part in weight.parts if isinstance(weight, BlockRows) else (weight,):
                part_bias = None if bias is None else bias[first : first + part.n]
                self._multiply(x, part, part_bias, out, first)
                first += part.n
        return out

    def _multiply(
        self, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None, out: torch.Tensor, first: int
    ) -> None:
        """out[:, first : first + weight.n] = x @ weight.T (+ bias)."""
        status = _entry(x.dtype, self.library)(
            x.data_ptr(),
            x.stride(0),
            weight.blocks.data_ptr(),
            weight.type,
            None if bias is None else bias.data_ptr(),
            out[:, first:].data_ptr(),
            out.stride(0),
            x.shape[0],
            weight.n,
            weight.k,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"block linear failed on a {weight.type_name} weight of input size {weight.k}")

    def widen(self, weight: BlockWeight) -> torch.Tensor:
        """The weight widened to float32 [n, k]: the values the float32 path multiplies, each the
        dequantized weight itself (the gguf package's value). Builds the float32 library if it is
        not loaded yet."""
        out = torch.empty(weight.n, weight.k, dtype=torch.float32)
        assert out.data_ptr() % 32 == 0, "torch's CPU allocations are 64-byte aligned"
        status = _library(torch.float32).duoserve_block_dequantize(
            weight.blocks.data_ptr(), weight.type, out.data_ptr(), weight.n, weight.k, torch.get_num_threads()
        )
        if status != 0:
            raise RuntimeError(
                f"widening a {weight.type_name} weight [{weight.n}, {weight.k}] failed ({status})"
            )
        return out


def _entry(dtype: torch.dtype, library: ctypes.CDLL | None = None) -> Callable[..., int]:
    """The kernel's C function for x in `dtype`: from `library` where it is that element type's
    build, else from this tree's (built, or found in the cache)."""
    name = "duoserve_block_linear_bf16" if dtype == torch.bfloat16 else "duoserve_block_linear"
    if library is None or not hasattr(library, name):
        library = _library(dtype)
    return getattr(library, name)  # type: ignore[no-any-return]


def _library(dtype: torch.dtype) -> ctypes.CDLL:
    """This tree's library for x in `dtype`, opened once."""
    with _lock:
        if dtype not in _loaded:
            _loaded[dtype] = open_library(dtype)
        return _loaded[dtype]


def dot_rows() -> int:
    """The most rows of x the bfloat16 build multiplies on AVX-512 BF16 dot products (where it
    has them), the rest widened and rounded: 2 on a CPU with AMX (measured on an Intel Xeon, where
    the dot products lost 4-11% at 4-6 rows and won 5-14% at 1-2), else every streamed row (6;
    on a Zen 4 they won 32-42% at 1-6 rows). bench/block_linear_ab.py measures both."""
    return DOT_ROWS_WITH_AMX if cpu_has("amx_bf16") else STREAM_ROWS


def open_library(
    dtype: torch.dtype,
    sources: Path = SOURCES,
    split_512: bool | None = None,
    types: Collection[int] | None = None,
) -> ctypes.CDLL:
    """The library built from `sources` (another revision's kernels/cpu, for a benchmark's A/B)
    for x in `dtype`, its codebooks handed over and its entries typed. `split_512`: build for a CPU
    that runs each 512-bit operation as two 256-bit halves (block_linear.c's SPLIT_512: float32
    streams on 256-bit registers, where the 512-bit path was 0.91-0.94x as fast on Zen 4, and the
    bfloat16 lookup computes each block's values on them); by default, whether this CPU does
    (`splits_512_bit_operations`). `types`: build only these block types (TYPE_MASK), which
    compiles in a fraction of the time; the library then refuses the others. By default, all."""
    split = splits_512_bit_operations() if split_512 is None else split_512
    defines = {"BFLOAT16": int(dtype == torch.bfloat16), "SPLIT_512": int(split)}
    if types is not None:
        assert types and all(0 <= t < 64 for t in types), f"types must be ggml type numbers, got {types}"
        defines["TYPE_MASK"] = sum(1 << t for t in set(types))
    library = load(build("block_linear.c", defines, sources))
    tables = codebook_tables()
    library.duoserve_block_linear_use_codebooks.argtypes = [ctypes.c_void_p] * len(tables)
    library.duoserve_block_linear_use_codebooks(*(table.ctypes.data for table in tables))
    if dtype == torch.bfloat16:
        entry = library.duoserve_block_linear_bf16
        if hasattr(library, "duoserve_block_linear_bf16_dot_products"):  # not in older revisions
            library.duoserve_block_linear_bf16_dot_products.restype = ctypes.c_int
            library.duoserve_block_linear_bf16_dot_products.argtypes = []
        if hasattr(library, "duoserve_block_linear_bf16_dot_rows"):
            library.duoserve_block_linear_bf16_dot_rows.restype = ctypes.c_int
            library.duoserve_block_linear_bf16_dot_rows.argtypes = [ctypes.c_int]
            library.duoserve_block_linear_bf16_dot_rows(dot_rows())
    else:
        entry = library.duoserve_block_linear
        library.duoserve_block_dequantize.restype = ctypes.c_int
        library.duoserve_block_dequantize.argtypes = _DEQUANTIZE_ARGTYPES
    entry.restype = ctypes.c_int
    entry.argtypes = _ARGTYPES
    return library


def require_cpu() -> None:
    """KernelBuildError where this CPU cannot run the kernel (it needs AVX2, FMA and F16C)."""
    missing = [flag for flag in ("avx2", "fma", "f16c") if not cpu_has(flag)]
    if missing:
        raise KernelBuildError(
            f"the block linear needs AVX2, FMA and F16C; this CPU lacks {', '.join(missing)}"
        )


def load_block_linear(dtype: torch.dtype = torch.float32) -> BlockLinear:
    """The kernel, its library for x in `dtype` (float32 or bfloat16) built or found in the cache;
    KernelBuildError where it cannot run. Each element type has a build of its own (15 s for
    float32 and 28 s for bfloat16 to compile on a 2-core Zen 4 with GCC 12, each in three parts
    side by side), so a worker builds only the one it multiplies in; kernels/cpu_prebuild.py
    builds both ahead."""
    require_cpu()
    if dtype not in DTYPES:
        raise ValueError(f"dtype: got {dtype}, expected torch.float32 or torch.bfloat16")
    _entry(dtype)
    return BlockLinear()


def block_linear_entry(dtype: torch.dtype) -> int:
    """The address of the kernel's C entry for x in `dtype` (float32 or bfloat16), for C code that
    calls it directly (the decode stack, kernels/cpu_stack.py); KernelBuildError where it cannot
    run."""
    load_block_linear(dtype)
    function: Any = _entry(dtype)  # the ctypes function itself
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


__all__ = [
    "DTYPES",
    "MAX_ROWS",
    "BlockLinear",
    "CodebookTables",
    "KernelBuildError",
    "block_linear_entry",
    "codebook_tables",
    "load_block_linear",
    "open_library",
    "require_cpu",
]

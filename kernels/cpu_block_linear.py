"""y = x @ weight.T (+ bias) in float32 on a weight kept as its file stores it, on the CPU, for decode
steps and prefill chunks: a GGUF file's blocks (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, IQ4_NL, the 4-bit
floats MXFP4 and NVFP4 (blocks of 64), and the super-blocks of 256 weights of the K-quants Q2_K to
Q6_K, of IQ4_XS, of the codebook types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S and
of the ternary TQ1_0 and TQ2_0), or 16-bit floats (F16, BF16) of a GGUF file or a safetensors
checkpoint, in 32-weight "blocks" of their own.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from kernels._launch import require
from kernels.cpu_build import SOURCES, KernelBuildError, build, cpu_has, load

MAX_ROWS = 256  # in float32 the worker takes oneDNN past this (gpu_worker/linear.py)
DTYPES = (torch.float32, torch.bfloat16)  # of x, the bias and y

# ggml's type numbers (as in a GGUF file) → bytes per block, of 32 weights (NVFP4: 64) or
# (super-blocks) 256.
F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 1, 2, 3, 6, 7, 8, 30
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 10, 11, 12, 13, 14, 20, 23
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M = 16, 17, 18, 19, 21, 22, 29
TQ1_0, TQ2_0, MXFP4, NVFP4 = 34, 35, 39, 40
BLOCK_BYTES = {
    F16: 64,
    Q4_0: 18,
    Q4_1: 20,
    Q5_0: 22,
    Q5_1: 24,
    Q8_0: 34,
    IQ4_NL: 18,
    Q2_K: 84,
    Q3_K: 110,
    Q4_K: 144,
    Q5_K: 176,
    Q6_K: 210,
    IQ4_XS: 136,
    IQ2_XXS: 66,
    IQ2_XS: 74,
    IQ2_S: 82,
    IQ3_XXS: 98,
    IQ3_S: 110,
    IQ1_S: 50,
    IQ1_M: 56,
    TQ1_0: 54,
    TQ2_0: 66,
    MXFP4: 17,
    NVFP4: 36,
    BF16: 64,
}
K_QUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
# Weights as rows of ggml's codebooks (gguf.quants' grids) with a sign each (IQ1's: a delta per row).
CODEBOOKS = (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
TERNARY = (TQ1_0, TQ2_0)  # weights of d times -1, 0 or 1
SUPER_BLOCKS = (*K_QUANTS, IQ4_XS, *CODEBOOKS, *TERNARY)  # the types of 256 weights a block
TYPE_NAMES = {type_: gguf.GGMLQuantizationType(type_).name for type_ in BLOCK_BYTES}  # ggml's own names
# The 16-bit float types: their blocks are the weight's own elements.
DENSE_TYPES = {torch.float16: F16, torch.bfloat16: BF16}
_TYPES_LISTED = ", ".join(f"{name} ({number})" for number, name in TYPE_NAMES.items())


def weights_per_block(type_: int) -> int:
    """Weights in one block of the type: 256 in a super-block (the K-quants', IQ4_XS's, the
    codebook types' and the ternary types'), 64 in NVFP4's, else 32."""
    return 256 if type_ in SUPER_BLOCKS else 64 if type_ == NVFP4 else 32


def row_bytes(type_: int, k: int) -> int:
    """Bytes of a row of k weights (k in whole blocks) as blocks of the type."""
    return k // weights_per_block(type_) * BLOCK_BYTES[type_]


@dataclass(frozen=True)
class BlockWeight:
    """A weight [n, k] as GGUF blocks: `blocks` is uint8 [n, row_bytes(type, k)]."""

    type: int  # one of BLOCK_BYTES
    blocks: torch.Tensor
    k: int

    def __post_init__(self) -> None:
        if self.type not in BLOCK_BYTES:
            raise ValueError(f"type: got ggml type {self.type}, expected one of {_TYPES_LISTED}")
        weights = weights_per_block(self.type)
        if self.k <= 0 or self.k % weights:
            raise ValueError(
                f"k: got {self.k}, expected a positive multiple of {weights} for {self.type_name} blocks"
            )
        require(
            self.blocks.dim() == 2
            and self.blocks.dtype == torch.uint8
            and self.blocks.device.type == "cpu"
            and self.blocks.is_contiguous()
            and self.blocks.shape[1] == row_bytes(self.type, self.k),
            "blocks",
            self.blocks,
            f"contiguous uint8 [n, {row_bytes(self.type, self.k)}] on the CPU",
        )

    @property
    def n(self) -> int:
        return self.blocks.shape[0]

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.type]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @classmethod
    def dense(cls, weight: torch.Tensor) -> BlockWeight:
        """A float16 or bfloat16 weight [n, k] (k in 32s, contiguous, on the CPU) as blocks that
        share its memory."""
        require(
            weight.dim() == 2
            and weight.dtype in DENSE_TYPES
            and weight.device.type == "cpu"
            and weight.is_contiguous(),
            "weight",
            weight,
            "a contiguous float16 or bfloat16 [n, k] CPU tensor",
        )
        return cls(DENSE_TYPES[weight.dtype], weight.view(torch.uint8), weight.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k] these blocks stand for."""
        for dtype, type_ in DENSE_TYPES.items():
            if self.type == type_:
                return self.blocks.view(dtype).float()
        return torch.from_numpy(_dequantize(self.blocks.numpy(), self.type).reshape(self.n, self.k))


@dataclass(frozen=True)
class BlockRows:
    """A fused weight (q/k/v, gate/up) stacked by rows from parts whose blocks differ in type, as a
    K-quant file often stores them (attn_v with more bits than attn_q and attn_k). The kernel
    multiplies each part into its own columns of y."""

    parts: tuple[BlockWeight, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or any(part.k != self.parts[0].k for part in self.parts):
            raise ValueError("parts: expected two or more block weights of one input size k")

    @property
    def n(self) -> int:
        return sum(part.n for part in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def type_name(self) -> str:
        return "+".join(dict.fromkeys(part.type_name for part in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


Blocks = BlockWeight | BlockRows


def concat_rows(weights: Sequence[BlockWeight]) -> Blocks | None:
    """The weights stacked by output rows (q, k, v → qkv): one BlockWeight where their types agree,
    their parts (BlockRows) where they do not; None where their inputs differ."""
    first = weights[0]
    if any(w.k != first.k for w in weights):
        return None
    if any(w.type != first.type for w in weights):
        return BlockRows(tuple(weights))
    return BlockWeight(first.type, torch.cat([w.blocks for w in weights]), first.k)


def _dequantize(blocks: np.ndarray, type_: int) -> np.ndarray:
    if type_ not in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1):  # the gguf package's own float32 dequantization
        return gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType(type_)).reshape(-1)
    raw = blocks.reshape(-1, BLOCK_BYTES[type_])
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)
    if type_ == Q8_0:
        return (d * raw[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    with_min = type_ in (Q4_1, Q5_1)
    start = 2 + 2 * with_min + 4 * (type_ in (Q5_0, Q5_1))  # after d, m and the fifth bits
    quants = raw[:, start:]
    values = np.concatenate([quants & 0x0F, quants >> 4], axis=1).astype(np.float32)
    offset = 8.0
    if type_ in (Q5_0, Q5_1):  # bit j of the little-endian uint32 before the quants: 16 on value j
        fifth = raw[:, start - 4 : start].copy().view("<u4")
        values += 16.0 * ((fifth >> np.arange(32, dtype=np.uint32)) & 1)
        offset = 16.0
    if with_min:
        m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
        return (d * values + m).reshape(-1)
    return (d * (values - offset)).reshape(-1)


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
        dtype_name = str(x.dtype).removeprefix("torch.")
        if bias is not None:
            require(
                bias.shape == (weight.n,) and bias.dtype == x.dtype and bias.is_contiguous(),
                "bias",
                bias,
                f"a contiguous {dtype_name} [{weight.n}] tensor, as x is {dtype_name}",
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


def open_library(dtype: torch.dtype, sources: Path = SOURCES) -> ctypes.CDLL:
    """The library built from `sources` (another revision's kernels/cpu, for a benchmark's A/B)
    for x in `dtype`, its codebooks handed over and its entries typed."""
    library = load(build("block_linear.c", {"BFLOAT16": int(dtype == torch.bfloat16)}, sources))
    tables = codebook_tables()
    library.duoserve_block_linear_use_codebooks.argtypes = [ctypes.c_void_p] * len(tables)
    library.duoserve_block_linear_use_codebooks(*(table.ctypes.data for table in tables))
    if dtype == torch.bfloat16:
        entry = library.duoserve_block_linear_bf16
    else:
        entry = library.duoserve_block_linear
        library.duoserve_block_dequantize.restype = ctypes.c_int
        library.duoserve_block_dequantize.argtypes = _DEQUANTIZE_ARGTYPES
    entry.restype = ctypes.c_int
    entry.argtypes = _ARGTYPES
    return library


def load_block_linear(dtype: torch.dtype = torch.float32) -> BlockLinear:
    """The kernel, its library for x in `dtype` (float32 or bfloat16) built or found in the cache;
    KernelBuildError where it cannot run. Each element type has a build of its own (about 10 s to
    compile on a 2-core EPYC), so a worker builds only the one it multiplies in."""
    missing = [flag for flag in ("avx2", "fma", "f16c") if not cpu_has(flag)]
    if missing:
        raise KernelBuildError(
            f"the block linear needs AVX2, FMA and F16C; this CPU lacks {', '.join(missing)}"
        )
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
    "BF16",
    "BLOCK_BYTES",
    "CODEBOOKS",
    "DENSE_TYPES",
    "DTYPES",
    "F16",
    "IQ1_M",
    "IQ1_S",
    "IQ2_S",
    "IQ2_XS",
    "IQ2_XXS",
    "IQ3_S",
    "IQ3_XXS",
    "IQ4_NL",
    "IQ4_XS",
    "K_QUANTS",
    "MAX_ROWS",
    "MXFP4",
    "NVFP4",
    "Q2_K",
    "Q3_K",
    "Q4_0",
    "Q4_1",
    "Q4_K",
    "Q5_0",
    "Q5_1",
    "Q5_K",
    "Q6_K",
    "Q8_0",
    "SUPER_BLOCKS",
    "TERNARY",
    "TQ1_0",
    "TQ2_0",
    "BlockLinear",
    "BlockRows",
    "BlockWeight",
    "Blocks",
    "CodebookTables",
    "KernelBuildError",
    "block_linear_entry",
    "codebook_tables",
    "concat_rows",
    "load_block_linear",
    "open_library",
    "row_bytes",
    "weights_per_block",
]

"""A weight as a GGUF file stores it: its blocks of 32 weights (NVFP4: 64) or super-blocks of 256,
in any quantized type the gguf package dequantizes, or 16-bit floats (F16, BF16) taken as blocks of
their own elements. `BlockWeight` is one such weight [n, k], `BlockRows` a fused one whose parts
differ in type; both dequantize to the float32 weight they stand for. The CPU block kernel
(kernels/cpu_block_linear.py) multiplies on them; the loader (gpu_worker/loader.py) reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from kernels._launch import require

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


__all__ = [
    "BF16",
    "BLOCK_BYTES",
    "CODEBOOKS",
    "DENSE_TYPES",
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
    "TYPE_NAMES",
    "BlockRows",
    "BlockWeight",
    "Blocks",
    "concat_rows",
    "row_bytes",
    "weights_per_block",
]

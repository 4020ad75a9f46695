"""The block linear (kernels/cpu/block_linear.c): float32 products on Q8_0/Q5_0/Q5_1/Q4_0/Q4_1 blocks, on
IQ4_NL blocks and Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_XS super-blocks (those written by bench/k_quants.py),
on IQ1_S/IQ1_M/IQ2_XXS/IQ2_XS/IQ2_S/IQ3_XXS/IQ3_S super-blocks (random ones: every byte pattern
around their fp16 d is a block), on TQ1_0/TQ2_0/MXFP4 blocks (written by the gguf package) and
NVFP4 blocks (bench/k_quants.py), on F16/BF16 weights, and its bfloat16 entry (x widened, y
rounded once)."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch

from bench import k_quants
from bench.requantize_gguf import matrix_type
from gpu_worker.linear import (
    BLOCK_MAX_ROWS,
    SMALL_STEP_ROWS,
    Linear,
    block_kernel,
    blocks_take,
    cpu_multiplies_bfloat16,
    packed_linear_available,
    small_steps_take_blocks,
)
from gpu_worker.loader import load_block_weights, load_model
from kernels.block_weights import (
    BF16,
    BLOCK_BYTES,
    CODEBOOKS,
    F16,
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    NVFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
    TERNARY,
    TYPE_NAMES,
    BlockRows,
    BlockWeight,
    concat_rows,
    row_bytes,
    weights_per_block,
)
from kernels.cpu_block_linear import (
    DTYPES,
    STREAM_ROWS,
    BlockLinear,
    KernelBuildError,
    dot_rows,
    load_block_linear,
    open_library,
)
from kernels.cpu_build import side_by_side
from scheduler.model_files import find_default_model
from tests.cpu_features import cpu_has

TYPES = {type_: gguf.GGMLQuantizationType(type_) for type_ in BLOCK_BYTES}  # every type the kernel takes


def whole(type_: int, k: int) -> int:
    """k rounded up to whole blocks of the type (a super-block's 256)."""
    return -(-k // weights_per_block(type_)) * weights_per_block(type_)


def block_weight(type_: int, n: int, k: int, seed: int) -> BlockWeight:
    """A random [n, k] weight quantized by the gguf package (the K-quants and IQ4 types by
    bench/k_quants.py), as a GGUF file stores it (its bytes: the package gives F16 as float16
    elements); of a codebook type, random blocks."""
    rng = np.random.default_rng(seed)
    if type_ in CODEBOOKS:
        return BlockWeight(
            type_, torch.from_numpy(k_quants.random_codebook_blocks(TYPE_NAMES[type_], n, k, rng)), k
        )
    dense = rng.standard_normal((n, k), dtype=np.float32) / k**0.5
    return BlockWeight(type_, torch.from_numpy(k_quants.write_blocks(dense, TYPE_NAMES[type_])), k)


@pytest.fixture(scope="module")
def kernel() -> BlockLinear:
    try:
        return load_block_linear()
    except KernelBuildError as exc:
        if all(cpu_has(flag) for flag in ("avx2", "fma", "f16c")):
            raise  # it must build on a CPU with what it needs
        pytest.skip(f"no block kernel on this CPU: {exc}")


@pytest.mark.parametrize("type_", sorted(TYPES))
def test_blocks_dequantize_as_the_gguf_package_does(type_: int) -> None:
    k = whole(type_, 96)
    weight = block_weight(type_, 7, k, seed=type_)
    stored = weight.blocks.numpy().view(np.float16) if type_ == F16 else weight.blocks.numpy()
    want = gguf.quants.dequantize(stored, TYPES[type_]).reshape(7, k)
    assert torch.equal(weight.dequantize(), torch.from_numpy(want).float())


WRITTEN = k_quants.WRITTEN  # the types bench/k_quants.py writes
BITS = {
    Q2_K: 2,
    Q3_K: 3,
    Q4_K: 4,
    Q5_K: 5,
    Q6_K: 6,
    IQ4_NL: 4,
    IQ4_XS: 4,
    IQ3_S: 3,
    IQ1_S: 1,
    IQ1_M: 1,
    NVFP4: 4,
    IQ2_XXS: 2,
    IQ2_XS: 2,
    IQ2_S: 2,
    IQ3_XXS: 2,  # 3.06 bits, but its 256 rows hold few of the 4096 fours of its 8 values
}


@pytest.mark.parametrize("type_", WRITTEN)
def test_written_blocks_hold_the_weight_they_were_written_from(type_: int) -> None:
    """bench/k_quants.py writes blocks that the gguf package reads back as the weight, to its
    quantization's error: every scale, minimum and quant bit where the layout puts it."""
    rng = np.random.default_rng(type_)
    dense = rng.standard_normal((24, 512), dtype=np.float32)
    # a row of small weights (NVFP4's E4M3 scales stop at 2^-9: a smaller row would round to 0),
    # one of zeros, one all positive, one all negative
    dense[3] *= 1e-2 if type_ == NVFP4 else 1e-3
    dense[4] = 0.0
    dense[5] = np.abs(dense[5])
    dense[6] = -np.abs(dense[6])
    blocks = k_quants.quantize(dense, TYPE_NAMES[type_])
    assert blocks.shape == (24, row_bytes(type_, 512)) and blocks.dtype == np.uint8
    back = gguf.quants.dequantize(blocks, TYPES[type_]).reshape(24, 512)
    assert np.all(back[4] == 0.0)
    for row in (0, 3, 5, 6, 7):  # within a few steps of a group's range, relative to the row
        error = np.abs(back[row] - dense[row]).max() / np.abs(dense[row]).max()
        assert error < 4 / 2 ** BITS[type_], (row, error)
    mean = np.abs(back - dense).mean() / np.abs(dense).mean()
    assert mean < 1.6 / 2 ** BITS[type_]
    with pytest.raises(ValueError, match="weight"):
        k_quants.quantize(dense[:, :300], TYPE_NAMES[type_])
    with pytest.raises(ValueError, match="type_name"):
        k_quants.quantize(dense, "MXFP4")  # the gguf package's to write (write_blocks)


def test_requantized_files_take_llama_cpps_types_and_fallbacks() -> None:
    """bench/requantize_gguf.py's choice per layer matrix (30 layers): the Q4_K_M and Q3_K_M mixes'
    rules, and rows not 256 long falling back as llama.cpp's quantizer does."""
    assert [matrix_type("Q4_K_M", "ffn_down", layer, 30, 1536) for layer in (0, 3, 4, 5, 26)] == [
        "Q6_K",
        "Q4_K",
        "Q4_K",
        "Q6_K",
        "Q6_K",
    ]  # the first and last eighth, and every third layer between
    assert matrix_type("Q4_K_M", "attn_q", 0, 30, 2048) == "Q4_K"
    assert [matrix_type("Q3_K_M", "attn_v", layer, 30, 2048) for layer in (0, 1, 2)] == [
        "Q5_K",
        "Q5_K",
        "Q4_K",
    ]
    assert [matrix_type("Q3_K_M", "ffn_down", layer, 30, 1536) for layer in (0, 1)] == ["Q5_K", "Q4_K"]
    assert matrix_type("Q3_K_M", "attn_output", 7, 30, 2048) == "Q4_K"
    assert matrix_type("Q3_K_M", "ffn_up", 7, 30, 2048) == "Q3_K"
    assert matrix_type("Q3_K_M", "ffn_up", 7, 30, 576) == "IQ4_NL"
    assert matrix_type("Q3_K_M", "attn_v", 0, 30, 576) == "Q5_1"
    fallbacks = {
        "Q2_K": "IQ4_NL",
        "Q3_K": "IQ4_NL",
        "IQ4_XS": "IQ4_NL",
        "IQ3_S": "IQ4_NL",
        "IQ3_XXS": "IQ4_NL",
        "IQ2_S": "IQ4_NL",
        "IQ2_XS": "IQ4_NL",
        "IQ2_XXS": "IQ4_NL",
        "TQ1_0": "Q4_0",
        "TQ2_0": "Q4_0",
        "IQ1_S": "IQ4_NL",
        "IQ1_M": "IQ4_NL",
        "Q4_K": "Q5_0",
        "Q5_K": "Q5_1",
        "Q6_K": "Q8_0",
    }
    for type_name, fallback in fallbacks.items():
        assert matrix_type(type_name, "attn_q", 0, 30, 576) == fallback
        assert matrix_type(type_name, "attn_q", 0, 30, 512) == type_name
    for type_name in ("IQ4_NL", "MXFP4", "NVFP4"):  # blocks of 32 and 64: no fallback
        assert matrix_type(type_name, "attn_q", 0, 30, 576) == type_name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_weight_is_its_own_blocks(dtype: torch.dtype) -> None:
    weight = torch.randn(5, 64).to(dtype)
    blocks = BlockWeight.dense(weight)
    assert blocks.type == {torch.float16: F16, torch.bfloat16: BF16}[dtype]
    assert (blocks.n, blocks.k) == (5, 64) and blocks.nbytes == weight.numel() * 2
    assert blocks.blocks.data_ptr() == weight.data_ptr()  # no copy
    assert torch.equal(blocks.dequantize(), weight.float())
    with pytest.raises(ValueError, match="weight"):
        BlockWeight.dense(weight.float())
    with pytest.raises(ValueError, match="weight"):
        BlockWeight.dense(weight.T)
    with pytest.raises(ValueError, match="k"):
        BlockWeight.dense(weight[:, :48].contiguous())


@pytest.mark.parametrize("type_", sorted(TYPES))
# Up to 6 rows stream the weight, and up to 12 for types of 32-weight blocks while rows * k <= 11264
# (7, 9, 12 at k <= 576, 7 at 1536: one addition chain a row); past that the tiled path takes rows
# 16 at a time (7 for the other types, 9 and 12 at k = 1536, 13, 16, 23: a group short, even, or
# seven over) and outputs in panels (301 x 1536: panels of 24, the last one short); 1-6 rows past
# whole groups stream after them (17, 22, 33).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 16, 17, 22, 23, 33])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (17, 64), (40, 576), (301, 1536)])
def test_kernel_matches_the_dequantized_product(
    kernel: BlockLinear, type_: int, rows: int, n: int, k: int
) -> None:
    k = whole(type_, k)  # a K-quant's rows: 256, 256, 768, 1536
    weight = block_weight(type_, n, k, seed=rows * n + k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    got = kernel(x, weight, bias)
    want = x.double() @ weight.dequantize().double().T + bias.double()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_", sorted(TYPES))
# streamed, streamed wide (tiled for the super-block types), tiled, tiled + streamed tail
@pytest.mark.parametrize("rows", [1, 6, 7, 12, 13, 17, 300])
def test_bfloat16_multiplies_the_bfloat16_weight(kernel: BlockLinear, type_: int, rows: int) -> None:
    k = whole(type_, 576)
    weight = block_weight(type_, 301, k, seed=rows + type_)
    as_bf16 = weight.dequantize().bfloat16()  # the model's bfloat16 copy of the weight
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, k + 24, generator=gen).bfloat16()
    x = wide[:, 7 : 7 + k]  # rows k + 24 elements apart
    bias = torch.randn(301, generator=gen).bfloat16()
    got = kernel(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 301)
    want = x.double() @ as_bf16.double().T + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5)  # y rounded once
    # Its float32 products and sums, rounded once, are those of a float32 matmul on the same
    # values but for the order of the additions.
    same = got == torch.nn.functional.linear(x.float(), as_bf16.float(), bias.float()).bfloat16()
    assert same.float().mean() > 0.99
    assert torch.equal(kernel(x, weight)[:, :5], kernel(x, weight, torch.zeros_like(bias))[:, :5])


@pytest.mark.parametrize("type_", [Q4_1, Q8_0, Q6_K])
def test_bfloat16_dot_products_take_the_rows_they_are_set_to(kernel: BlockLinear, type_: int) -> None:
    """Up to dot_rows() rows take the dot products where the build has them (2 with AMX, else all
    6 streamed rows); the limit may be set from 0 to 6, and either path gives the product."""
    if not kernel.dot_products:
        assert kernel.dot_rows() == 0 == kernel.dot_rows(4)
        return
    assert kernel.dot_rows() == dot_rows() == (2 if cpu_has("amx_bf16") else STREAM_ROWS)
    k = whole(type_, 576)
    weight = block_weight(type_, 64, k, seed=type_)
    as_bf16 = weight.dequantize().bfloat16()
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(type_)).bfloat16()
    want = x.double() @ as_bf16.double().T
    try:
        for limit in (0, 4, 6):
            assert kernel.dot_rows(limit) == limit and kernel.dot_rows() == limit
            torch.testing.assert_close(kernel(x, weight).double(), want, rtol=2**-8, atol=1e-5)
        assert kernel.dot_rows(100) == STREAM_ROWS
    finally:
        kernel.dot_rows(dot_rows())


@pytest.mark.parametrize("type_", sorted(TYPES))
def test_float32_widens_to_the_dequantized_values(kernel: BlockLinear, type_: int) -> None:
    """Each widened weight is the gguf package's float32 value itself, not one close to it."""
    k = whole(type_, 576)
    weight = block_weight(type_, 40, k, seed=3 * type_)
    picked = torch.arange(0, k, 9)
    x = torch.zeros(len(picked), k)
    x[torch.arange(len(picked)), picked] = 1.0  # y[r, o] = w[o, picked[r]], one product each
    want = weight.dequantize()[:, picked].T
    assert torch.equal(kernel(x, weight), want)  # tiled
    for rows in (1, 2, 3):  # streamed: four chains of sums a row up to two rows, two past that
        assert torch.equal(kernel(x[:rows], weight), want[:rows])


WIDTH_TYPES = (Q4_0, Q4_1, Q8_0, IQ4_NL, MXFP4)  # what the register-width tests multiply


@pytest.fixture(scope="module")
def widths() -> dict[tuple[torch.dtype, bool], BlockLinear]:
    """Each element type's kernel built without and with SPLIT_512, by (dtype, split), for the block
    types the tests below multiply: the builds compiled side by side, one a core (a build of every
    type took 20-40 s; of these five, a few)."""
    builds = [(dtype, split) for dtype in (torch.float32, torch.bfloat16) for split in (False, True)]
    libraries = side_by_side(
        functools.partial(open_library, dtype, split_512=split, types=WIDTH_TYPES) for dtype, split in builds
    )
    return {build: BlockLinear(library) for build, library in zip(builds, libraries, strict=True)}


@pytest.mark.skipif(not cpu_has("avx512bw"), reason="the float32 512-bit path needs AVX-512 BW")
@pytest.mark.parametrize("type_", [Q4_0, Q4_1, Q8_0])
def test_float32_streams_the_same_values_on_either_register_width(
    widths: dict[tuple[torch.dtype, bool], BlockLinear], type_: int
) -> None:
    """The float32 build streams Q4_0, Q4_1 and Q8_0 on 512-bit registers or, where the CPU splits
    those in two (SPLIT_512), on 256-bit ones: both builds, whichever this CPU takes,
    give each weight as the gguf package dequantizes it, and products equal to float32 rounding."""
    k = whole(type_, 576)
    weight = block_weight(type_, 40, k, seed=7 * type_)
    picked = torch.arange(0, k, 5)
    x = torch.zeros(len(picked), k)
    x[torch.arange(len(picked)), picked] = 1.0
    want = weight.dequantize()[:, picked].T
    gen = torch.Generator().manual_seed(type_)
    dense = torch.randn(STREAM_ROWS, k, generator=gen)
    sums = {}
    for split in (False, True):
        kernel = widths[torch.float32, split]
        for rows in range(1, STREAM_ROWS + 1):
            assert torch.equal(kernel(x[:rows], weight), want[:rows])
        sums[split] = kernel(dense, weight)
        torch.testing.assert_close(
            sums[split].double(), dense.double() @ weight.dequantize().double().T, rtol=1e-5, atol=1e-5
        )
    assert not torch.equal(sums[True], sums[False])  # two paths: the additions in other orders


@pytest.mark.skipif(
    not (cpu_has("avx512_bf16") and cpu_has("avx512bw")),
    reason="the bfloat16 lookup needs AVX-512 BF16 and BW",
)
@pytest.mark.parametrize("type_", [Q4_0, Q4_1, IQ4_NL, MXFP4])
def test_bfloat16_lookup_takes_the_same_values_on_either_register_width(
    widths: dict[tuple[torch.dtype, bool], BlockLinear], type_: int
) -> None:
    """The bfloat16 build computes a block's 16 values on 512-bit registers or, where the CPU splits
    those in two (SPLIT_512), in 256-bit halves: each weight is the bfloat16 copy's value either
    way, and the two builds' products are the same bits."""
    k = whole(type_, 96)
    weight = block_weight(type_, 24, k, seed=13 * type_)
    want = weight.dequantize().bfloat16().T
    eye = torch.eye(k, dtype=torch.bfloat16)
    dense = torch.randn(STREAM_ROWS, k, generator=torch.Generator().manual_seed(type_)).bfloat16()
    sums = []
    for split in (False, True):
        kernel = widths[torch.bfloat16, split]
        assert kernel.dot_products
        got = torch.cat([kernel(eye[i : i + 2], weight) for i in range(0, k, 2)])
        assert torch.equal(got, want)
        sums.append(kernel(dense, weight))
    assert torch.equal(sums[0], sums[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_build_of_some_types_refuses_the_others(
    widths: dict[tuple[torch.dtype, bool], BlockLinear], dtype: torch.dtype
) -> None:
    """TYPE_MASK leaves a type's code out of the build; a call on it fails as an unknown type does,
    instead of returning what was in y."""
    weight = block_weight(Q5_0, 16, 64, seed=5)
    x = torch.randn(2, 64).to(dtype)
    assert Q5_0 not in WIDTH_TYPES
    for split in (False, True):
        with pytest.raises(RuntimeError, match="block linear failed on a Q5_0 weight"):
            widths[dtype, split](x, weight)
        built = block_weight(Q4_0, 16, 64, seed=5)
        torch.testing.assert_close(
            widths[dtype, split](x, built).float(), x.float() @ built.dequantize().T, rtol=2e-2, atol=2e-2
        )


@pytest.mark.parametrize("type_", sorted(TYPES))
def test_bfloat16_steps_of_two_rows_take_each_weight_as_the_bfloat16_copy_holds_it(
    kernel: BlockLinear, type_: int
) -> None:
    """Two-row steps stream (on dot products where the CPU has them; with AVX-512 BW, Q4_0 and Q4_1
    weights are looked up by nibble among their block's 16 rounded values): every weight of every
    position of a block is the model's bfloat16 copy's value, to the bit."""
    k = whole(type_, 96)
    weight = block_weight(type_, 24, k, seed=11 * type_)
    want = weight.dequantize().bfloat16().T  # [k, n]: row i is what x = e_i picks
    eye = torch.eye(k, dtype=torch.bfloat16)
    got = torch.cat([kernel(eye[i : i + 2], weight) for i in range(0, k, 2)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("type_", sorted(TYPES))
@pytest.mark.parametrize("n", [1, 7, 42])  # short of, past and at whole tiles of six rows
def test_widening_a_weight_gives_its_dequantized_values(kernel: BlockLinear, type_: int, n: int) -> None:
    """The float32 copies a worker makes of its weights (`widen`) are the gguf package's values."""
    k = whole(type_, 576)
    weight = block_weight(type_, n, k, seed=5 * type_ + n)
    assert torch.equal(kernel.widen(weight), weight.dequantize())


@pytest.mark.parametrize("type_", [MXFP4, NVFP4])
def test_every_fp4_scale_byte_widens_to_its_value(kernel: BlockLinear, type_: int) -> None:
    """MXFP4's e8m0 and NVFP4's E4M3 scales, all 256 bytes of each (the writers make only some:
    subnormal, 2^127, NVFP4's 0x7f and bytes with bit 7 set), as the gguf package reads them."""
    rng = np.random.default_rng(type_)
    per_row = 4  # blocks
    raw = rng.integers(0, 256, size=(64, per_row, BLOCK_BYTES[type_]), dtype=np.uint8)
    if type_ == MXFP4:
        raw[:, :, 0] = np.arange(256, dtype=np.uint8).reshape(64, per_row)
    else:  # the first block's four scale bytes, one for each 16 weights
        raw[:, 0, :4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
    blocks = raw.reshape(64, -1)
    weight = BlockWeight(type_, torch.from_numpy(blocks), per_row * weights_per_block(type_))
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(blocks, TYPES[type_]).reshape(64, weight.k)
    assert np.isinf(want).any() == (type_ == MXFP4)  # 2^127 times 12 overflows float32, as there
    assert torch.equal(kernel.widen(weight), torch.from_numpy(want))


@pytest.mark.parametrize("type_", sorted(set(TYPES) - {BF16}))  # BF16 weights are bfloat16 already
def test_bfloat16_weights_are_rounded_to_bfloat16(kernel: BlockLinear, type_: int) -> None:
    k = whole(type_, 576)
    weight = block_weight(type_, 301, k, seed=type_)
    dense = weight.dequantize()
    picked = torch.arange(0, k, 9)
    x = torch.zeros(len(picked), k, dtype=torch.bfloat16)
    x[torch.arange(len(picked)), picked] = 3.0  # y[r, o] = 3 * w[o, picked[r]], one product each
    got = kernel(x, weight)
    want = (3 * dense.bfloat16().float()[:, picked].T).bfloat16()
    assert torch.equal(got, want)
    # From the unrounded weight some would differ: the rounding is what this checks. A quarter of
    # them where each weight has bits of its own; ternary weights share one d per 256, of which few
    # round differently; 4-bit floats times their scale have at most 7 bits: bfloat16 values already.
    differ = (want != (3 * dense[:, picked].T).bfloat16()).float().mean()
    if type_ in (MXFP4, NVFP4):
        assert torch.equal(dense.bfloat16().float(), dense)
    else:
        assert differ > (0.01 if type_ in TERNARY else 0.1)


@pytest.mark.parametrize("rows", [5, 40])  # both paths
def test_rows_of_x_may_be_strided(kernel: BlockLinear, rows: int) -> None:
    weight = block_weight(Q4_1, 16, 64, seed=1)
    wide = torch.randn(rows, 100)
    x = wide[:, 3:67]  # rows 100 floats apart
    assert x.stride() == (100, 1)
    want = x.double() @ weight.dequantize().double().T
    torch.testing.assert_close(kernel(x, weight).double(), want, rtol=1e-5, atol=1e-5)
    assert kernel(x[:0], weight).shape == (0, 16)


@pytest.mark.parametrize("threads", [1, 3])
def test_any_number_of_threads_covers_every_output(kernel: BlockLinear, threads: int) -> None:
    weight = block_weight(Q8_0, 301, 576, seed=threads)
    x = torch.randn(40, 576)
    want = x.double() @ weight.dequantize().double().T
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(x, weight)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused_by_name(kernel: BlockLinear) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_block_linear(torch.float16)  # builds for float32 and bfloat16 x only
    weight = block_weight(Q8_0, 4, 64, seed=2)
    with pytest.raises(ValueError, match="x"):
        kernel(torch.randn(2, 64).half(), weight)
    with pytest.raises(ValueError, match=r"bias.*as x is bfloat16"):
        kernel(torch.randn(2, 64).bfloat16(), weight, torch.randn(4))
    with pytest.raises(ValueError, match="x"):
        kernel(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="x"):
        kernel(torch.randn(64, 2).T, weight)  # columns not contiguous
    with pytest.raises(ValueError, match="bias"):
        kernel(torch.randn(2, 64), weight, torch.randn(5))
    with pytest.raises(ValueError, match="blocks"):
        BlockWeight(Q8_0, torch.zeros(4, 40, dtype=torch.uint8), 64)  # Q8_0 rows of 64 are 68 bytes
    with pytest.raises(ValueError, match="type"):
        BlockWeight(41, torch.zeros(4, 36, dtype=torch.uint8), 256)  # Q1_0: not a block kernel type
    with pytest.raises(ValueError, match=r"k: got 32, expected a positive multiple of 64 for NVFP4"):
        BlockWeight(NVFP4, torch.zeros(4, 18, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="k"):
        BlockWeight(Q4_0, torch.zeros(4, 18, dtype=torch.uint8), 48)
    with pytest.raises(ValueError, match=r"k: got 288, expected a positive multiple of 256 for Q4_K"):
        BlockWeight(Q4_K, torch.zeros(4, 162, dtype=torch.uint8), 288)
    with pytest.raises(ValueError, match="blocks"):
        BlockWeight(Q6_K, torch.zeros(4, 2 * 144, dtype=torch.uint8), 512)  # Q6_K rows of 512 are 420 bytes


def test_rows_stack_as_one_weight_or_as_parts() -> None:
    a, b = block_weight(Q4_1, 3, 64, seed=3), block_weight(Q4_1, 5, 64, seed=4)
    stacked = concat_rows([a, b])
    assert isinstance(stacked, BlockWeight) and stacked.n == 8
    assert torch.equal(stacked.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = block_weight(Q8_0, 3, 64, seed=5)
    mixed = concat_rows([a, c, b])  # types differ: kept as parts
    assert isinstance(mixed, BlockRows) and mixed.parts == (a, c, b)
    assert (mixed.n, mixed.k, mixed.type_name) == (11, 64, "Q4_1+Q8_0")
    assert mixed.nbytes == a.nbytes + b.nbytes + c.nbytes
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize(), b.dequantize()]))
    assert concat_rows([a, block_weight(Q4_1, 3, 96, seed=6)]) is None
    with pytest.raises(ValueError, match="parts"):
        BlockRows((a,))
    with pytest.raises(ValueError, match="parts"):
        BlockRows((a, block_weight(Q8_0, 3, 96, seed=6)))


@pytest.mark.parametrize("rows", [1, 5, 17, 40])  # streamed, tiled, tiled + tail
@pytest.mark.parametrize("dtype", DTYPES)
def test_parts_multiply_into_their_own_columns(kernel: BlockLinear, rows: int, dtype: torch.dtype) -> None:
    """A K-quant file's q/k/v in Q4_K, Q4_K and Q6_K: each part into its columns of y, the bias's
    slices with them; each part's columns equal to that part multiplied alone."""
    q, k, v = (
        block_weight(Q4_K, 48, 512, seed=1),
        block_weight(Q4_K, 16, 512, seed=2),
        block_weight(Q6_K, 16, 512, seed=3),
    )
    qkv = concat_rows([q, k, v])
    assert isinstance(qkv, BlockRows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    got = kernel(x, qkv, bias)
    assert got.shape == (rows, 80) and got.dtype == dtype
    first = 0
    for part in (q, k, v):
        assert torch.equal(got[:, first : first + part.n], kernel(x, part, bias[first : first + part.n]))
        first += part.n
    want = x.double() @ qkv.dequantize().double().T + bias.double()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


def test_linear_takes_blocks_for_decode_sized_steps_only(kernel: BlockLinear) -> None:
    weight = block_weight(Q4_1, 48, 128, seed=7)
    dense = weight.dequantize()
    lin = Linear(
        dense, None, packed=packed_linear_available(torch.float32, torch.device("cpu")), blocks=weight
    )
    assert lin.blocks is weight
    for rows in (1, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1, 100):
        x = torch.randn(rows, 128)
        assert lin.takes_block_kernel(x) == (rows <= BLOCK_MAX_ROWS)
        torch.testing.assert_close(lin(x).double(), x.double() @ dense.double().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="blocks"):
        Linear(dense[:, :96].contiguous(), None, packed=False, blocks=weight)


def test_bfloat16_linears_take_blocks_where_the_cpu_cannot_multiply_bfloat16(kernel: BlockLinear) -> None:
    weight = block_weight(Q4_1, 48, 128, seed=8)
    lin = Linear(weight.dequantize().bfloat16(), None, packed=False, blocks=weight)
    cpu = torch.device("cpu")
    assert blocks_take(torch.float32, cpu) and not blocks_take(torch.float16, cpu)
    if cpu_multiplies_bfloat16():  # its own kernels multiply bfloat16 faster than rounding blocks
        assert not blocks_take(torch.bfloat16, cpu)
        small_steps = small_steps_take_blocks(torch.bfloat16, cpu) and kernel.dot_products
        assert (lin.blocks is weight) == small_steps  # see the next test
        return
    assert blocks_take(torch.bfloat16, cpu) and lin.blocks is weight
    for rows in (1, BLOCK_MAX_ROWS + 1, 1000):  # every size: torch's bfloat16 matmul is emulated here
        x = torch.randn(rows, 128).bfloat16()
        assert lin.takes_block_kernel(x)
        assert lin(x).dtype == torch.bfloat16 and torch.equal(lin(x), kernel(x, weight))


@pytest.mark.skipif(
    not small_steps_take_blocks(torch.bfloat16, torch.device("cpu")),
    reason="small bfloat16 steps take the blocks on CPUs with AVX-512 BF16 and no AMX",
)
@pytest.mark.parametrize("type_", [Q4_1, Q8_0, Q6_K])
def test_bfloat16_steps_of_one_or_two_rows_take_the_blocks_dot_products(
    kernel: BlockLinear, type_: int
) -> None:
    """Where the CPU multiplies bfloat16 with AVX-512 BF16, the bfloat16 build streams on dot
    products, and a bfloat16 linear keeps its blocks for steps of up to SMALL_STEP_ROWS rows only:
    the pair-layout kernel (here F.linear: not packed) takes the others, on the same rounded weights."""
    assert kernel.dot_products
    k = whole(type_, 256)
    weight = block_weight(type_, 40, k, seed=9)
    as_bf16 = weight.dequantize().bfloat16()
    lin = Linear(as_bf16, None, packed=False, blocks=weight)
    assert lin.blocks is weight and lin.block_max_rows == SMALL_STEP_ROWS
    for rows in (1, SMALL_STEP_ROWS, SMALL_STEP_ROWS + 1, 7):
        x = torch.randn(rows, k).bfloat16()
        assert lin.takes_block_kernel(x) == (rows <= SMALL_STEP_ROWS)
        got = lin(x)
        if rows <= SMALL_STEP_ROWS:
            assert torch.equal(got, kernel(x, weight))
        # The same products of bfloat16 values, summed in another order, rounded once.
        want = x.double() @ as_bf16.double().T
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5)
    # A weight held as blocks alone (--dense-weights drop) takes them at every size.
    alone = Linear(torch.empty(40, k, dtype=torch.bfloat16, device="meta"), None, packed=False, blocks=weight)
    assert alone.blocks_only and alone.takes_block_kernel(torch.randn(64, k).bfloat16())


@pytest.fixture(scope="module")
def smollm2_blocks() -> tuple[dict[str, torch.Tensor], dict[str, BlockWeight]]:
    path = find_default_model()
    config, weights = load_model(path)
    return weights, load_block_weights(path, config)


def test_default_model_blocks_are_its_weights(
    smollm2_blocks: tuple[dict[str, torch.Tensor], dict[str, BlockWeight]],
) -> None:
    weights, blocks = smollm2_blocks
    # SmolLM2-135M's GGUF: every layer linear in Q4_1, the tied embedding / head in Q8_0.
    assert len(blocks) == 7 * 30 + 1
    assert blocks["model.embed_tokens.weight"].type == Q8_0
    assert {b.type for name, b in blocks.items() if name.startswith("model.layers.")} == {Q4_1}
    for name, block in blocks.items():
        # The very values load_model dequantizes, q and k rows in the same (Hugging Face) order.
        assert torch.equal(block.dequantize(), weights[name]), name
    assert sum(b.nbytes for b in blocks.values()) == sum(
        weights[name].numel() // 32 * BLOCK_BYTES[b.type] for name, b in blocks.items()
    )
    assert all(b.nbytes == b.n * row_bytes(b.type, b.k) for b in blocks.values())


def test_hf_directories_give_their_16_bit_weights(tmp_path: Path) -> None:
    stored = {
        "model.layers.0.self_attn.o_proj.weight": torch.randn(48, 64).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96).half(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 64),  # float32: no blocks
        "model.layers.0.input_layernorm.weight": torch.randn(64).bfloat16(),  # 1-D
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 40).bfloat16(),  # k not in 32s
    }
    safetensors.torch.save_file(stored, str(tmp_path / "model.safetensors"))
    blocks = load_block_weights(tmp_path, None)  # type: ignore[arg-type]
    assert set(blocks) == {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    assert blocks["model.layers.0.self_attn.o_proj.weight"].type == BF16
    assert blocks["model.layers.0.mlp.down_proj.weight"].type == F16
    for name, block in blocks.items():
        assert torch.equal(block.dequantize(), stored[name].float()), name
    assert load_block_weights(tmp_path, None, sixteen_bit=False) == {}  # type: ignore[arg-type]


def test_gguf_16_bit_weights_are_blocks_too(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    f16 = rng.standard_normal((48, 64)).astype(np.float16)
    bf16 = gguf.quants.quantize(rng.standard_normal((64, 96)).astype(np.float32), TYPES[BF16])
    writer = gguf.GGUFWriter(tmp_path / "small.gguf", arch="llama")
    writer.add_tensor("blk.0.attn_output.weight", f16)
    writer.add_tensor("blk.0.ffn_down.weight", bf16, raw_dtype=TYPES[BF16])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", np.ones((8, 40), dtype=np.float16))  # rows not in 32s
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blocks = load_block_weights(tmp_path / "small.gguf", None)  # type: ignore[arg-type]
    assert set(blocks) == {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    o, down = blocks["model.layers.0.self_attn.o_proj.weight"], blocks["model.layers.0.mlp.down_proj.weight"]
    assert (o.type, o.n, o.k) == (F16, 48, 64) and (down.type, down.n, down.k) == (BF16, 64, 96)
    assert torch.equal(o.dequantize(), torch.from_numpy(f16).float())
    want = gguf.quants.dequantize(bf16, TYPES[BF16]).reshape(64, 96)
    assert torch.equal(down.dequantize(), torch.from_numpy(want))
    assert load_block_weights(tmp_path / "small.gguf", None, sixteen_bit=False) == {}  # type: ignore[arg-type]


HF_NAMES = {
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """blk.L.ffn_up.weight → model.layers.L.mlp.up_proj.weight (the matrices these tests write)."""
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[kind]}.weight"


def gguf_of(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    """A llama GGUF file at `path` holding these tensors, each (type name, its blocks' bytes)."""
    writer = gguf.GGUFWriter(path, arch="llama")
    for name, (type_name, blocks) in tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_k_quant_and_iq4_weights_are_blocks(tmp_path: Path) -> None:
    """K-quant and IQ4 tensors of a GGUF file come as blocks, the values load_model dequantizes."""
    rng = np.random.default_rng(1)
    stored = {
        "blk.0.attn_output.weight": ("Q4_K", rng.standard_normal((64, 256), dtype=np.float32)),
        "blk.0.ffn_down.weight": ("Q6_K", rng.standard_normal((256, 512), dtype=np.float32)),
        "blk.0.ffn_up.weight": ("Q5_K", rng.standard_normal((512, 256), dtype=np.float32)),
        "blk.0.ffn_gate.weight": ("Q3_K", rng.standard_normal((512, 256), dtype=np.float32)),
        "blk.1.ffn_up.weight": ("Q2_K", rng.standard_normal((256, 256), dtype=np.float32)),
        "blk.1.attn_output.weight": ("IQ4_NL", rng.standard_normal((64, 256), dtype=np.float32)),
        "blk.0.attn_v.weight": ("IQ4_XS", rng.standard_normal((64, 256), dtype=np.float32)),
    }
    written = {
        name: (type_name, k_quants.quantize(dense, type_name)) for name, (type_name, dense) in stored.items()
    }
    blocks = load_block_weights(gguf_of(tmp_path / "k.gguf", written), None)  # type: ignore[arg-type]
    assert set(blocks) == {hf_name(name) for name in stored}
    for gguf_name, (type_name, dense) in stored.items():
        block = blocks[hf_name(gguf_name)]
        assert (block.type_name, block.n, block.k) == (type_name, *dense.shape)
        want = gguf.quants.dequantize(
            k_quants.quantize(dense, type_name), gguf.GGMLQuantizationType[type_name]
        )
        assert torch.equal(block.dequantize(), torch.from_numpy(want.reshape(dense.shape)))


def assert_file_blocks_hold_their_values(
    path: Path, written: dict[str, tuple[str, np.ndarray]], shapes: dict[str, tuple[int, int]]
) -> None:
    """`written` (GGUF name → type name, blocks' bytes) in a GGUF file at `path` come back from
    load_block_weights as blocks of their type and shape, with the values the gguf package
    dequantizes them to, and multiply on the kernel (where there is one) as those values."""
    blocks = load_block_weights(gguf_of(path, written), None)  # type: ignore[arg-type]
    assert set(blocks) == {hf_name(name) for name in written}
    kernel = block_kernel()
    for gguf_name, (type_name, raw) in written.items():
        block, shape = blocks[hf_name(gguf_name)], shapes[gguf_name]
        assert (block.type_name, block.n, block.k) == (type_name, *shape)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
        assert torch.equal(block.dequantize(), torch.from_numpy(want.reshape(shape)))
        if kernel is not None:
            x = torch.randn(3, shape[1])
            torch.testing.assert_close(
                kernel(x, block).double(), x.double() @ block.dequantize().double().T, rtol=1e-5, atol=1e-5
            )


def test_gguf_codebook_weights_are_blocks(tmp_path: Path) -> None:
    """IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S tensors of a GGUF file come as
    blocks, with the values the gguf package dequantizes them to, and multiply on the kernel as
    those values."""
    rng = np.random.default_rng(2)
    stored = {
        "blk.0.attn_v.weight": "IQ2_XXS",
        "blk.0.attn_output.weight": "IQ2_XS",
        "blk.0.ffn_up.weight": "IQ2_S",
        "blk.0.ffn_gate.weight": "IQ3_XXS",
        "blk.0.ffn_down.weight": "IQ3_S",
        "blk.1.ffn_up.weight": "IQ1_S",
        "blk.1.ffn_down.weight": "IQ1_M",
    }
    shape = (64, 512)
    written = {
        name: (type_name, k_quants.random_codebook_blocks(type_name, *shape, rng))
        for name, type_name in stored.items()
    }
    assert_file_blocks_hold_their_values(tmp_path / "iq.gguf", written, dict.fromkeys(stored, shape))


def test_gguf_ternary_and_fp4_weights_are_blocks(tmp_path: Path) -> None:
    """TQ1_0, TQ2_0, MXFP4 and NVFP4 tensors of a GGUF file (written by the gguf package, NVFP4 by
    bench/k_quants.py) come as blocks, with the values the gguf package dequantizes them to, and
    multiply on the kernel as those values."""
    rng = np.random.default_rng(3)
    stored = {
        "blk.0.attn_output.weight": ("TQ1_0", (64, 512)),
        "blk.0.attn_v.weight": ("TQ2_0", (32, 512)),
        "blk.0.ffn_up.weight": ("MXFP4", (96, 160)),
        "blk.0.ffn_down.weight": ("NVFP4", (160, 192)),
    }
    written = {
        name: (type_name, k_quants.write_blocks(rng.standard_normal(shape, dtype=np.float32), type_name))
        for name, (type_name, shape) in stored.items()
    }
    shapes = {name: shape for name, (_, shape) in stored.items()}
    assert_file_blocks_hold_their_values(tmp_path / "tq.gguf", written, shapes)


def test_a_bfloat16_linear_multiplies_on_itself_with_self_blocks(kernel: BlockLinear) -> None:
    weight = torch.randn(48, 128).bfloat16()
    mine = Linear(weight, None, packed=False, self_blocks=True)
    assert Linear(weight, None, packed=False).blocks is None  # only when asked (--block-linear)
    assert Linear(weight.float(), None, packed=False, self_blocks=True).blocks is None
    if cpu_multiplies_bfloat16():
        assert mine.blocks is None  # its own kernels multiply bfloat16 faster
        return
    assert mine.blocks is not None and mine.blocks.type == BF16
    assert mine.blocks.blocks.data_ptr() == weight.data_ptr()  # no copy
    x = torch.randn(3, 128).bfloat16()
    assert torch.equal(mine(x), kernel(x, BlockWeight.dense(weight)))
    # Quantized blocks of the file's are kept; the file's BF16 blocks give way to the same values
    # in the weight itself.
    q = block_weight(Q4_1, 48, 128, seed=9)
    assert Linear(q.dequantize().bfloat16(), None, packed=False, blocks=q, self_blocks=True).blocks is q
    copy = BlockWeight.dense(weight.clone())
    kept = Linear(weight, None, packed=False, blocks=copy, self_blocks=True).blocks
    assert kept is not None and kept.blocks.data_ptr() == weight.data_ptr()


def test_the_worker_path_loads_it_here() -> None:
    # x86-64 CPUs of the last decade have AVX2, FMA and F16C; CI's do.
    if all(cpu_has(flag) for flag in ("avx2", "fma", "f16c")):
        assert block_kernel() is not None


def test_a_kernel_bound_to_a_library_from_other_sources_multiplies_on_it(
    kernel: BlockLinear, tmp_path: Path
) -> None:
    """bench/block_linear_ab.py's two kernels: a library opened from a copy of the sources (an
    unchanged one, so the cached build) gives this tree's bits, and every float32 product goes
    through it; x in bfloat16, which that build has no entry for, takes this tree's library."""
    import shutil

    from kernels import cpu_build

    sources = tmp_path / "cpu"
    shutil.copytree(cpu_build.SOURCES, sources)
    library = open_library(torch.float32, sources)
    calls = []

    class Recording:  # the library, counting the calls that reach its float32 entry
        def __getattr__(self, name: str) -> object:
            function = getattr(library, name)
            if name != "duoserve_block_linear":
                return function
            return lambda *args: calls.append(args) or function(*args)

    theirs = BlockLinear(Recording())  # type: ignore[arg-type]
    weight = block_weight(Q4_1, 40, 256, seed=5)
    x = torch.randn(3, 256)
    assert torch.equal(theirs(x, weight), kernel(x, weight))
    assert len(calls) == 1
    assert torch.equal(theirs(x.bfloat16(), weight), kernel(x.bfloat16(), weight))
    assert len(calls) == 1

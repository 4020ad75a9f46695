"""The int8 KV cache (`--kv-cache-dtype int8`): its quantized write and the CPU decode kernel that reads it."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_build import KernelBuildError, side_by_side
from kernels.cpu_decode import load_cpu_decode_attention, paged_decode_attention_reference
from kernels.kv_int8 import (
    Int8Cache,
    dequantize,
    dequantize_slots,
    quantize_cache,
    quantize_rows,
    write_kv_int8,
)
from tests.test_cpu_decode_kernel import TOLERANCE, VECTOR_PATHS, edge_builds, make_case


def test_quantized_rows_are_within_half_a_step_of_the_input() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    x[4, 1] = 0.0  # an all-zero row: scale 0, values 0, no NaN
    q, scales = quantize_rows(x)
    assert q.dtype == torch.int8 and scales.shape == (50, 3)
    assert int(q.abs().max()) == 127
    back = q.float() * scales[..., None]
    assert torch.isfinite(back).all() and float(back[4, 1].abs().max()) == 0.0
    assert bool((back - x).abs().le(scales[..., None] * 0.5 + 1e-6).all())


def test_write_puts_rows_and_scales_at_their_slots_and_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = Int8Cache.zeros(4, 8, 2, 16, "cpu"), Int8Cache.zeros(4, 8, 2, 16, "cpu")
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([0, 9, -1, 31, 17])
    write_kv_int8(k_cache, v_cache, k, v, slots)
    keep = slots >= 0
    for cache, rows in ((k_cache, k), (v_cache, v)):
        back = dequantize_slots(cache, slots[keep], torch.float32)
        scales = quantize_rows(rows[keep])[1]
        assert bool((back - rows[keep]).abs().le(scales[..., None] * 0.5 + 1e-6).all())
        untouched = torch.ones(32, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert int(cache.values.view(32, -1)[untouched].abs().sum()) == 0
        assert float(cache.scales.transpose(1, 2).reshape(32, -1)[untouched].abs().sum()) == 0.0


INT8_EDGE_SHAPES = [(16, 3, 3, 64), (8, 1, 8, 128), (32, 4, 1, 64), (24, 2, 3, 40), (8, 1, 16, 8)]


@pytest.fixture(scope="module", autouse=True)
def _edge_variants_compiled() -> None:
    side_by_side(edge_builds(INT8_EDGE_SHAPES, kv_int8=True))


@pytest.mark.parametrize("vector_bits", VECTOR_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "head_dim"), INT8_EDGE_SHAPES)
def test_int8_kernel_matches_reference_at_block_edges(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int, head_dim: int, vector_bits: int
) -> None:
    """Every intrinsics path a CPU may take, on an int8 cache: the reference attends to the rows
    times their scales in float32, which is what the kernel computes."""
    b = block_size
    lengths = [1, 2, b - 1, b, b + 1, 2 * b - 1, 2 * b, 2 * b + 1, 7 * b + 3]
    q, k_dense, v_dense, tables, lens = make_case(lengths, b, num_kv_heads, group, head_dim, dtype)
    k_cache, v_cache = quantize_cache(k_dense), quantize_cache(v_dense)
    kernel = load_cpu_decode_attention(head_dim, group, block_size, dtype, vector_bits, kv_int8=True)
    out = kernel(q, k_cache, v_cache, tables, lens)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # And it stays close to attention over the unquantized cache: int8 rows lose about 0.4% of a row's largest value.
    dense = paged_decode_attention_reference(q, k_dense, v_dense, tables, lens)
    assert float((out.float() - dense.float()).abs().max()) < 0.05


@pytest.mark.parametrize("lengths", [[1000, 600], [1000], [600], [2049, 5]])
def test_int8_kernel_split_work_items_match_the_reference(lengths: list[int]) -> None:
    """Long sequences in few: the step is split into parts of 128 tokens (per kv head or all of them)."""
    q, k_dense, v_dense, tables, lens = make_case(lengths, 16, 3, 3, 64, torch.bfloat16, seed=7)
    k_cache, v_cache = quantize_cache(k_dense), quantize_cache(v_dense)
    kernel = load_cpu_decode_attention(64, 3, 16, torch.bfloat16, kv_int8=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = kernel(q, k_cache, v_cache, tables, lens)
    finally:
        torch.set_num_threads(threads)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_int8_kernel_refuses_a_dense_cache_and_the_dense_kernel_an_int8_one() -> None:
    q, k_dense, v_dense, tables, lens = make_case([20], 16, 3, 3, 64, torch.bfloat16)
    int8 = load_cpu_decode_attention(64, 3, 16, torch.bfloat16, kv_int8=True)
    dense = load_cpu_decode_attention(64, 3, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache"):
        int8(q, k_dense, v_dense, tables, lens)
    with pytest.raises(ValueError, match="k_cache"):
        dense(q, quantize_cache(k_dense), quantize_cache(v_dense), tables, lens)
    bad = quantize_cache(k_dense)
    with pytest.raises(ValueError, match="scales"):
        int8(
            q, Int8Cache(bad.values, bad.scales[:, :, :8].contiguous()), quantize_cache(v_dense), tables, lens
        )


def test_dequantize_gives_the_rows_times_their_scales() -> None:
    cache = quantize_cache(torch.randn(3, 8, 2, 16))
    dense = dequantize(cache, torch.float32)
    slots = torch.arange(24)
    torch.testing.assert_close(
        dequantize_slots(cache, slots, torch.float32), dense.view(24, 2, 16), rtol=0, atol=0
    )


@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the scalar loop (the vector one takes 16s)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_write_equals_the_reference_bit_for_bit(dtype: torch.dtype, head_dim: int) -> None:
    """The fused C write (kernels/cpu_fused.py) on strided rows (views into a qkv buffer), skipping
    slot -1; 200 tokens are shared out over the threads."""
    from kernels.cpu_fused import load_cpu_fused_ops

    d = head_dim
    gen = torch.Generator().manual_seed(2)
    qkv = (torch.randn(200, 9 * d + 2 * 3 * d, generator=gen) * 3).to(dtype)
    k = qkv[:, 9 * d : 12 * d].view(200, 3, d)
    v = qkv[:, 12 * d :].view(200, 3, d)
    k[2, 1] = 0  # an all-zero row
    k[3, 0, 5] = 1e30  # a huge value: the rest of its row rounds to 0
    slots = torch.randperm(16 * 16, generator=gen)[:200]
    slots[7] = -1
    ours = (Int8Cache.zeros(16, 16, 3, d, "cpu"), Int8Cache.zeros(16, 16, 3, d, "cpu"))
    reference = (Int8Cache.zeros(16, 16, 3, d, "cpu"), Int8Cache.zeros(16, 16, 3, d, "cpu"))
    load_cpu_fused_ops(dtype).write_kv(k, v, ours[0], ours[1], slots)
    write_kv_int8(reference[0], reference[1], k, v, slots)
    for mine, theirs in zip(ours, reference, strict=True):
        assert torch.equal(mine.values, theirs.values)
        assert torch.equal(mine.scales, theirs.scales)
    with pytest.raises(ValueError, match="k_cache: the K and V caches must both be int8"):
        load_cpu_fused_ops(dtype).write_kv(k, v, ours[0], torch.zeros(16, 16, 3, d, dtype=dtype), slots)
    with pytest.raises(ValueError, match="slot_mapping: slots must be < 256"):  # the C write trusts them
        load_cpu_fused_ops(dtype).write_kv(k, v, ours[0], ours[1], torch.full_like(slots, 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_dequantize_equals_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    from kernels.cpu_fused import load_cpu_fused_ops

    cache = quantize_cache(torch.randn(5, 16, 3, 64) * 4)
    slots = torch.tensor([0, 79, 16, 33, 15, 64])
    out = torch.empty(6, 3, 64, dtype=dtype)
    load_cpu_fused_ops(dtype).dequantize_kv_int8(cache, slots, out)
    assert torch.equal(out, dequantize_slots(cache, slots, dtype))
    with pytest.raises(ValueError, match="slots"):
        load_cpu_fused_ops(dtype).dequantize_kv_int8(
            cache, torch.tensor([80]), torch.empty(1, 3, 64, dtype=dtype)
        )


@pytest.mark.parametrize("fused", [True, False], ids=["c-ops", "torch-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_on_an_int8_cache_matches_attention_on_the_dense_cache(
    dtype: torch.dtype, fused: bool
) -> None:
    """A mixed batch (decodes at block edges, a chunk behind a cached prefix, a fresh prompt) through
    the cpu backend on an int8 cache, with the C write and dequantization or their torch
    definitions, against the torch backend on the same cache contents unquantized: they differ by
    the quantization alone. The int8 cache then holds the step's rows, quantized."""
    from gpu_worker.attention import CpuPagedAttention, TorchPagedAttention
    from gpu_worker.batch import ScheduledChunk, build_forward_batch
    from kernels.cpu_fused import load_cpu_fused_ops
    from kernels.cpu_prefill import load_prefill_attention

    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 16
    torch.manual_seed(0)
    dense_k = torch.randn(40, block_size, num_kv_heads, head_dim).to(dtype)
    dense_v = torch.randn_like(dense_k)
    k_cache, v_cache = quantize_cache(dense_k), quantize_cache(dense_v)
    dense_k, dense_v = (
        dequantize(k_cache, dtype),
        dequantize(v_cache, dtype),
    )  # the same contents, unquantized
    chunks = [
        ScheduledChunk([1], start_position=0, block_table=[3], needs_logits=True),
        ScheduledChunk(
            [1, 2, 3], start_position=29, block_table=[5, 7], needs_logits=True
        ),  # behind a prefix
        ScheduledChunk(
            [4], start_position=32, block_table=[8, 9, 10], needs_logits=True
        ),  # decode at a boundary
        ScheduledChunk([5, 6], start_position=0, block_table=[11], needs_logits=True),  # fresh prompt
    ]
    batch = build_forward_batch(chunks, block_size, "cpu")
    q = torch.randn(batch.num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(batch.num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(batch.num_tokens, num_kv_heads, head_dim).to(dtype)
    kernel = load_cpu_decode_attention(head_dim, num_heads // num_kv_heads, block_size, dtype, kv_int8=True)
    try:
        prefill = load_prefill_attention(head_dim, dtype=dtype) if fused else None
    except KernelBuildError:  # a CPU without the prefill kernel: torch's attention
        prefill = None
    attention = CpuPagedAttention(
        num_heads,
        num_kv_heads,
        head_dim,
        kernel=kernel,
        fused_ops=load_cpu_fused_ops(dtype) if fused else None,
        prefill_kernel=prefill,
    )
    out = attention(q, k, v, (k_cache, v_cache), batch)
    expected = TorchPagedAttention(num_heads, num_kv_heads, head_dim)(q, k, v, (dense_k, dense_v), batch)
    assert float((out.float() - expected.float()).abs().max()) < 0.05
    # The step's own rows went into the int8 cache at their slots, quantized.
    written = dequantize_slots(k_cache, batch.slot_mapping, torch.float32)
    assert float((written - k.float()).abs().max()) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_backend_on_an_int8_cache_matches_the_cpu_backend(dtype: torch.dtype) -> None:
    """The reference backend (and the one a CPU without the C kernels, or float16, takes) writes
    the same quantized cache and attends to its rows times their scales; decodes and the chunk
    behind its prefix alike to rounding (torch's SDPA in the dtype, the C kernel in float32)."""
    from gpu_worker.attention import CpuPagedAttention, TorchPagedAttention
    from gpu_worker.batch import ScheduledChunk, build_forward_batch
    from kernels.cpu_fused import load_cpu_fused_ops

    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 16
    torch.manual_seed(2)
    base_k = torch.randn(12, block_size, num_kv_heads, head_dim).to(dtype)
    base_v = torch.randn_like(base_k)
    chunks = [
        ScheduledChunk([1], start_position=20, block_table=[3, 4], needs_logits=True),
        ScheduledChunk([4], start_position=32, block_table=[0, 1, 2], needs_logits=True),  # a block edge
        ScheduledChunk([1, 2, 3], start_position=29, block_table=[5, 7, 8], needs_logits=True),
        ScheduledChunk([5, 6], start_position=0, block_table=[11], needs_logits=True),
    ]
    batch = build_forward_batch(chunks, block_size, "cpu")
    q = torch.randn(batch.num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(batch.num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(batch.num_tokens, num_kv_heads, head_dim).to(dtype)
    kernel = load_cpu_decode_attention(head_dim, num_heads // num_kv_heads, block_size, dtype, kv_int8=True)
    cpu_caches, torch_caches = (
        (quantize_cache(base_k), quantize_cache(base_v)),
        (quantize_cache(base_k), quantize_cache(base_v)),
    )
    cpu = CpuPagedAttention(
        num_heads, num_kv_heads, head_dim, kernel=kernel, fused_ops=load_cpu_fused_ops(dtype)
    )
    expected = cpu(q, k, v, cpu_caches, batch)
    out = TorchPagedAttention(num_heads, num_kv_heads, head_dim)(q, k, v, torch_caches, batch)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    for mine, theirs in zip(torch_caches, cpu_caches, strict=True):
        assert torch.equal(mine.values, theirs.values) and torch.equal(mine.scales, theirs.scales)


def test_a_cpu_worker_without_the_c_kernel_takes_the_int8_cache_to_the_torch_backend() -> None:
    """float16 has no C decode kernel: the worker falls back to the torch backend, int8 cache and all;
    the cpu backend on a CUDA device is refused as ever."""
    from gpu_worker.attention import CpuPagedAttention, TorchPagedAttention
    from gpu_worker.model_config import ModelConfig
    from gpu_worker.startup import make_attention

    config = ModelConfig(
        name="tiny", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, context_length=256, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=None, eos_token_ids=(2,),
    )  # fmt: skip
    backend = make_attention("auto", config, torch.float16, torch.device("cpu"), 16, kv_int8=True)
    assert type(backend) is TorchPagedAttention
    assert isinstance(
        make_attention("auto", config, torch.float32, torch.device("cpu"), 16, kv_int8=True),
        CpuPagedAttention,
    )
    with pytest.raises(SystemExit, match="--attention-backend cpu runs on the CPU only"):
        make_attention("cpu", config, torch.float32, torch.device("cuda"), 16, kv_int8=True)


def test_an_int8_block_holds_close_to_twice_the_tokens_of_a_bfloat16_one() -> None:
    from gpu_worker.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
    from gpu_worker.model_config import ModelConfig

    config = ModelConfig(
        name="smol", vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, context_length=8192, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=None, eos_token_ids=(2,),
    )  # fmt: skip
    dense = kv_cache_bytes_per_block(config, 16, torch.bfloat16)
    int8 = kv_cache_bytes_per_block(config, 16, torch.bfloat16, kv_int8=True)
    assert dense == 2 * 30 * 16 * 3 * 64 * 2 and int8 == 2 * 30 * 16 * 3 * (64 + 4)
    cache = allocate_kv_cache(config, 2, 16, torch.bfloat16, "cpu", kv_int8=True)
    layer_bytes = sum(c.values.nbytes + c.scales.nbytes for c in cache[0] if isinstance(c, Int8Cache))
    assert layer_bytes * config.num_layers == 2 * int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_backend_on_an_int8_cache_matches_the_cpu_backend(dtype: torch.dtype) -> None:
    """The triton backend's int8 write, decode and prefill (on a GPU, or here through Triton's
    interpreter) against the cpu backend's C kernels on the same mixed batch: the same quantized
    cache bit for bit, the rows that read it alike to the kernels' rounding."""
    pytest.importorskip("triton")
    from gpu_worker.attention import CpuPagedAttention, TritonPagedAttention
    from gpu_worker.batch import ScheduledChunk, build_forward_batch
    from kernels.cpu_fused import load_cpu_fused_ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 16
    torch.manual_seed(1)
    base_k = torch.randn(12, block_size, num_kv_heads, head_dim).to(dtype)
    base_v = torch.randn_like(base_k)
    chunks = [
        ScheduledChunk([1], start_position=20, block_table=[3, 4], needs_logits=True),  # decode
        ScheduledChunk(
            [1, 2, 3], start_position=29, block_table=[5, 7, 8], needs_logits=True
        ),  # behind a prefix
        ScheduledChunk([5, 6], start_position=0, block_table=[11], needs_logits=True),  # fresh prompt
    ]
    q = torch.randn(6, num_heads, head_dim).to(dtype)
    k = torch.randn(6, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(6, num_kv_heads, head_dim).to(dtype)
    cpu_caches = (quantize_cache(base_k), quantize_cache(base_v))
    cpu = CpuPagedAttention(
        num_heads,
        num_kv_heads,
        head_dim,
        kernel=load_cpu_decode_attention(
            head_dim, num_heads // num_kv_heads, block_size, dtype, kv_int8=True
        ),
        fused_ops=load_cpu_fused_ops(dtype),
    )
    expected = cpu(q, k, v, cpu_caches, build_forward_batch(chunks, block_size, "cpu"))
    on_device = (quantize_cache(base_k).to(device), quantize_cache(base_v).to(device))
    triton = TritonPagedAttention(num_heads, num_kv_heads, head_dim)
    batch = build_forward_batch(chunks, block_size, device)
    out = triton(q.to(device), k.to(device), v.to(device), on_device, batch)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float().cpu(), expected.float(), atol=tolerance, rtol=tolerance)
    for mine, theirs in zip(on_device, cpu_caches, strict=True):
        assert torch.equal(mine.values.cpu(), theirs.values) and torch.equal(mine.scales.cpu(), theirs.scales)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_attends_to_the_same_values_fresh_or_behind_its_cached_prefix(
    backend: str, dtype: torch.dtype
) -> None:
    """A prompt's last 40 tokens, as part of the whole prompt in one chunk or as a chunk behind its
    first 60 (which a prefix-cache hit or chunked prefill makes of it): the same bits. Its chunks
    attend to the step's own rows as the int8 cache holds them, so greedy output does not depend on
    what the cache held before (the soak test asks the same of every repeated prompt)."""
    from gpu_worker.attention import CpuPagedAttention, TorchPagedAttention
    from gpu_worker.batch import ScheduledChunk, build_forward_batch
    from kernels.cpu_fused import load_cpu_fused_ops
    from kernels.cpu_prefill import load_prefill_attention

    heads, kv_heads, dim, block_size, n, p = 9, 3, 64, 16, 100, 60
    torch.manual_seed(3)
    q, k, v = (torch.randn(n, h, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    if backend == "cpu":
        try:
            prefill = load_prefill_attention(dim, dtype=dtype)
        except KernelBuildError:
            prefill = None
        kernel = load_cpu_decode_attention(dim, heads // kv_heads, block_size, dtype, kv_int8=True)
        attention: TorchPagedAttention = CpuPagedAttention(
            heads, kv_heads, dim, kernel=kernel, fused_ops=load_cpu_fused_ops(dtype), prefill_kernel=prefill
        )
    else:
        attention = TorchPagedAttention(heads, kv_heads, dim)
    table = list(range(8))

    def fresh_caches() -> tuple[Int8Cache, Int8Cache]:
        return Int8Cache.zeros(10, block_size, kv_heads, dim, "cpu"), Int8Cache.zeros(
            10, block_size, kv_heads, dim, "cpu"
        )

    whole = attention(
        q,
        k,
        v,
        fresh_caches(),
        build_forward_batch([ScheduledChunk(list(range(n)), 0, table, True)], block_size, "cpu"),
    )
    caches = fresh_caches()
    first = build_forward_batch([ScheduledChunk(list(range(p)), 0, table, True)], block_size, "cpu")
    attention(q[:p], k[:p], v[:p], caches, first)
    behind = build_forward_batch([ScheduledChunk(list(range(p, n)), p, table, True)], block_size, "cpu")
    rest = attention(q[p:], k[p:], v[p:], caches, behind)
    assert torch.equal(whole[p:], rest)

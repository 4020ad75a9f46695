"""The CPU paged decode attention kernel against its torch reference, and its launcher's checks."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_worker.attention import CpuPagedAttention, TorchPagedAttention
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from kernels.cpu_build import side_by_side
from kernels.cpu_decode import (
    KernelBuildError,
    build_cpu_decode_attention,
    check_block_tables,
    load_cpu_decode_attention,
    paged_decode_attention_reference,
)
from tests.cpu_features import has_avx2_fma

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SAME_ARITHMETIC = {torch.float32: 1e-6, torch.bfloat16: 8e-3}  # float32 rounding; one bfloat16 ulp near 1


def make_case(
    lengths: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random q and caches; each sequence's blocks scattered over the pool, tables padded past their end."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_needed) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_needed) + 1  # one more column than any row needs: the kernel must stop at the length
    tables = torch.full((len(lengths), width), num_blocks - 1, dtype=torch.int32)
    for row, count in enumerate(blocks_needed):
        tables[row, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


VECTOR_PATHS = [
    pytest.param(512, id="native"),
    pytest.param(
        256, id="avx2", marks=pytest.mark.skipif(not has_avx2_fma(), reason="this CPU has no AVX2 and FMA")
    ),
    pytest.param(0, id="plain-c"),
]


EDGE_SHAPES = [  # (block_size, num_kv_heads, group, head_dim)
    (16, 3, 3, 64),
    (8, 1, 8, 128),
    (32, 4, 1, 64),
    (16, 2, 4, 32),
    (24, 2, 3, 40),
    (8, 1, 16, 8),
    (12, 2, 2, 16),
    # A whole-sequence item of more than 16 query rows: the softmax steps 16 rows, then the rest.
    (16, 6, 3, 32),
    (16, 4, 8, 64),
]
DTYPES = [torch.float32, torch.bfloat16]


def vector_bits_here() -> list[int]:
    """The VECTOR_PATHS this CPU runs (the AVX2 one only with AVX2 and FMA)."""
    return [512, *([256] if has_avx2_fma() else []), 0]


def edge_builds(shapes: list[tuple[int, int, int, int]], kv_int8: bool) -> list[Callable[[], object]]:
    """The builds of every edge test variant: each shape, dtype and vector path."""
    return [
        functools.partial(build_cpu_decode_attention, head_dim, group, block, dtype, bits, kv_int8)
        for block, _, group, head_dim in shapes
        for dtype in DTYPES
        for bits in vector_bits_here()
    ]


@pytest.fixture(scope="module", autouse=True)
def _edge_variants_compiled() -> None:
    side_by_side(edge_builds(EDGE_SHAPES, kv_int8=False))


@pytest.mark.parametrize("vector_bits", VECTOR_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "head_dim"), EDGE_SHAPES)
def test_kernel_matches_reference_at_block_edges(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int, head_dim: int, vector_bits: int
) -> None:
    """Each build a CPU may run: the widest intrinsics path this CPU has (AVX-512 for block sizes
    of 16s and head_dim of 32s), AVX2 + FMA (block sizes of 8s), and plain C."""
    b = block_size
    lengths = [1, 2, b - 1, b, b + 1, 2 * b - 1, 2 * b, 2 * b + 1, 7 * b + 3]
    q, k_cache, v_cache, tables, lens = make_case(lengths, b, num_kv_heads, group, head_dim, dtype)
    kernel = load_cpu_decode_attention(head_dim, group, block_size, dtype, vector_bits)
    if vector_bits == 256:  # the path asked for, where it applies
        assert kernel.vector_path == (256 if block_size % 8 == 0 else 0)
    if vector_bits == 0:
        assert kernel.vector_path == 0
    out = kernel(q, k_cache, v_cache, tables, lens)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_sequence_per_head_and_split_work_items_agree(dtype: torch.dtype) -> None:
    """On 2 threads: 14 sequences (at least 4 per thread) go to the threads whole (every kv head's
    rows read front to back). Fewer, with one longer than 512 tokens, are split into parts of 128
    tokens: all kv heads an item where the step has at least 8 parts (1000 tokens alone; 128, 129
    and 1000), one kv head an item where it has fewer (600 alone), their parts folded after. Fewer
    and shorter go as (sequence, kv head) items. Every way computes the same parts and folds them
    in the same order, so the results agree up to the order the compiler adds a dot product's
    lanes in (float32 rounding)."""
    lengths = [1, 15, 16, 17, 33, 64, 100, 7, 250, 48, 128, 129, 1000, 600]
    q, k_cache, v_cache, tables, lens = make_case(lengths, 16, 3, 3, 64, dtype, seed=5)
    kernel = load_cpu_decode_attention(64, 3, 16, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        whole = kernel(q, k_cache, v_cache, tables, lens)
        for row in range(len(lengths)):
            one = kernel(q[row : row + 1], k_cache, v_cache, tables[row : row + 1], lens[row : row + 1])
            torch.testing.assert_close(one, whole[row : row + 1], atol=SAME_ARITHMETIC[dtype], rtol=0)
        for rows in (slice(0, 3), slice(8, 11), slice(10, 13)):
            three = kernel(q[rows], k_cache, v_cache, tables[rows], lens[rows])
            torch.testing.assert_close(three, whole[rows], atol=SAME_ARITHMETIC[dtype], rtol=0)
    finally:
        torch.set_num_threads(threads)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(whole.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_two_lanes_calling_at_once_keep_their_parts_apart() -> None:
    """Two lanes may decode at once; a split step keeps its parts in a buffer of the calling thread's."""
    cases = [make_case([700 + 300 * lane], 16, 3, 3, 64, torch.float32, seed=lane) for lane in range(2)]
    kernel = load_cpu_decode_attention(64, 3, 16, torch.float32)
    alone = [kernel(*case) for case in cases]
    results: list[list[torch.Tensor]] = [[], []]

    def lane(index: int) -> None:
        for _ in range(20):
            results[index].append(kernel(*cases[index]))

    threads = [threading.Thread(target=lane, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(2):
        assert len(results[index]) == 20
        assert all(torch.equal(out, alone[index]) for out in results[index])


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_kernel_matches_reference_over_a_long_context_and_large_scores(
    dtype: torch.dtype, tolerance: float
) -> None:
    # 2049 tokens (128 blocks + 1) and scores in the hundreds: the online softmax must rescale stably.
    q, k_cache, v_cache, tables, lens = make_case([2049, 5], 16, 3, 3, 64, dtype, seed=3)
    q = q * 30
    kernel = load_cpu_decode_attention(64, 3, 16, dtype)
    out = kernel(q, k_cache, v_cache, tables, lens)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_kernel_reads_only_the_blocks_in_the_table() -> None:
    q, k_cache, v_cache, tables, lens = make_case([20], 8, 1, 2, 16, torch.float32)
    kernel = load_cpu_decode_attention(16, 2, 8, torch.float32)
    before = kernel(q, k_cache, v_cache, tables, lens).clone()
    unused = sorted(set(range(k_cache.shape[0])) - set(tables[0, :3].tolist()))
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    assert torch.equal(kernel(q, k_cache, v_cache, tables, lens), before)


def test_launcher_rejects_bad_shapes_dtypes_and_strides() -> None:
    q, k_cache, v_cache, tables, lens = make_case([5, 9], 16, 3, 3, 64, torch.float32)
    kernel = load_cpu_decode_attention(64, 3, 16, torch.float32)
    with pytest.raises(ValueError, match=r"q: expected torch\.float32 on cpu"):
        kernel(q.bfloat16(), k_cache, v_cache, tables, lens)
    with pytest.raises(ValueError, match="q: expected a contiguous"):
        kernel(q.transpose(0, 1), k_cache, v_cache, tables, lens)
    with pytest.raises(ValueError, match="block_size: expected 16"):
        kernel(q, k_cache.view(-1, 8, 3, 64), v_cache.view(-1, 8, 3, 64), tables, lens)
    with pytest.raises(ValueError, match="num_heads"):
        kernel(q[:, :6].contiguous(), k_cache, v_cache, tables, lens)
    with pytest.raises(
        ValueError, match=r"block_tables: expected a contiguous int32 \[2, max_blocks\] tensor"
    ):
        kernel(q, k_cache, v_cache, tables.long(), lens)
    with pytest.raises(ValueError, match="context_lens"):
        kernel(q, k_cache, v_cache, tables, lens[:1])


def test_block_table_check_names_the_bad_values() -> None:
    tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    check_block_tables(tables, torch.tensor([17, 3], dtype=torch.int32), num_blocks=3, block_size=16)
    with pytest.raises(ValueError, match=r"context_lens must be in \[1, 32\], got \[0, 17\]"):
        check_block_tables(tables, torch.tensor([17, 0], dtype=torch.int32), num_blocks=3, block_size=16)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 2\), got \[0, 2\]"):
        check_block_tables(tables, torch.tensor([17, 3], dtype=torch.int32), num_blocks=2, block_size=16)
    # Columns past a context are padding, whatever they hold; a used negative id is refused.
    padded = torch.tensor([[0, -1], [2, 99]], dtype=torch.int32)
    check_block_tables(padded, torch.tensor([16, 3], dtype=torch.int32), num_blocks=3, block_size=16)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 3\), got \[-1, 2\]"):
        check_block_tables(padded, torch.tensor([17, 3], dtype=torch.int32), num_blocks=3, block_size=16)


def test_unsupported_shapes_and_missing_compiler_raise_kernel_build_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(KernelBuildError, match="head_dim=60"):
        load_cpu_decode_attention(60, 1, 16, torch.float32)
    with pytest.raises(KernelBuildError, match="float16"):
        load_cpu_decode_attention(64, 1, 16, torch.float16)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("DUOSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KernelBuildError, match="not found"):
        load_cpu_decode_attention(24, 5, 4, torch.float32)  # a shape no other test loads


def test_kernel_library_is_cached_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kernels import cpu_decode

    monkeypatch.setenv("DUOSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "_loaded", {})
    first = load_cpu_decode_attention(8, 1, 4, torch.float32)
    assert first.library_path.parent == tmp_path and first.library_path.exists()
    monkeypatch.setattr(cpu_decode, "_loaded", {})
    built_at = first.library_path.stat().st_mtime_ns
    second = load_cpu_decode_attention(8, 1, 4, torch.float32)
    assert second.library_path == first.library_path
    assert second.library_path.stat().st_mtime_ns == built_at  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.library_path.name]  # no partial files left


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_equals_torch_backend_on_a_mixed_batch(dtype: torch.dtype) -> None:
    """Decodes through the kernel, prefill chunks through torch: the backends agree on every row."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 8
    torch.manual_seed(0)
    num_blocks = 40
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    chunks = [
        ScheduledChunk([1], start_position=0, block_table=[3], needs_logits=True),  # decode, length 1
        ScheduledChunk([1, 2, 3], start_position=9, block_table=[5, 7], needs_logits=True),  # cached prefix
        ScheduledChunk(
            [4], start_position=16, block_table=[8, 9, 10], needs_logits=True
        ),  # decode at a boundary
        ScheduledChunk([5, 6], start_position=0, block_table=[11], needs_logits=True),  # fresh prefill
    ]
    batch = build_forward_batch(chunks, block_size, "cpu")
    tokens = batch.num_tokens
    q = torch.randn(tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim).to(dtype)
    kernel = load_cpu_decode_attention(head_dim, num_heads // num_kv_heads, block_size, dtype)
    outputs = []
    for backend in (TorchPagedAttention(num_heads, num_kv_heads, head_dim), None):
        attention = backend or CpuPagedAttention(num_heads, num_kv_heads, head_dim, kernel=kernel)
        outputs.append(attention(q, k, v, (k_cache.clone(), v_cache.clone()), batch))
    torch.testing.assert_close(
        outputs[1].float(), outputs[0].float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )

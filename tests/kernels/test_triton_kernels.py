"""Every Triton kernel against its torch reference, at the shapes that hit the edges.

On a machine without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py), on a GPU on the device: the same tests, the GPU subset of `make gpu-check`.
"""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch

pytest.importorskip("triton")

from gpu_worker.model import rope_inv_freq
from gpu_worker.model_config import Llama3RopeScaling, ModelConfig
from kernels.fused_ops import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rotary_embedding,
    rotary_embedding_reference,
    silu_and_mul,
    silu_and_mul_reference,
    write_kv,
    write_kv_reference,
)
from kernels.kv_int8 import Int8Cache, quantize_cache, write_kv_int8
from kernels.paged_attention import (
    _decode_reduce_kernel,
    _decode_split_kernel,
    _prefill_kernel,
    decode_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def random_cache(
    lengths: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches with each sequence's blocks scattered over the pool; tables padded with a spare block."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lengths), max(needed) + 1), order[-1], dtype=torch.int32)
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tolerance, rtol=tolerance)


# ------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group"), [(16, 3, 3), (8, 2, 1), (32, 1, 8)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_attention_matches_reference(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int, num_splits: int | None
) -> None:
    b = block_size
    lengths = [1, b - 1, b, b + 1, 5 * b + 3]
    head_dim = 64
    k_cache, v_cache, tables = random_cache(lengths, b, num_kv_heads, head_dim, dtype, seed=b + group)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(dtype).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, max(lengths), num_splits=num_splits)
    assert_close(
        out,
        paged_decode_attention_reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu()),
        dtype,
    )


@pytest.mark.parametrize(("length", "splits"), [(1025, (1, 8, None)), (8192, (None,))])
def test_decode_attention_splits_one_long_context_and_keeps_large_scores_stable(
    length: int, splits: tuple[int | None, ...]
) -> None:
    # One sequence of 1024 + 1 tokens (65 blocks), or SmolLM2's whole context: split-K spreads it out.
    k_cache, v_cache, tables = random_cache([length], 16, 1, 128, torch.float32, seed=7)
    q = (torch.randn(1, 2, 128, generator=torch.Generator().manual_seed(2)) * 20).to(DEVICE)
    lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    expected = paged_decode_attention_reference(
        q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu()
    )
    for num_splits in splits:
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, length, num_splits=num_splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "num_splits"), [(16, 3, 3, 1), (8, 2, 1, 3)])
def test_decode_attention_reads_an_int8_cache(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int, num_splits: int
) -> None:
    """`--kv-cache-dtype int8` on CUDA: the rows times their scales, against the same definition
    as the CPU kernel's (the reference dequantizes to float32)."""
    b = block_size
    lengths = [1, b - 1, b + 1, 4 * b + 3]
    dense_k, dense_v, tables = random_cache(lengths, b, num_kv_heads, 64, dtype, seed=b + group)
    k_cache, v_cache = quantize_cache(dense_k.cpu()).to(DEVICE), quantize_cache(dense_v.cpu()).to(DEVICE)
    q = torch.randn(len(lengths), num_kv_heads * group, 64, generator=torch.Generator().manual_seed(4))
    q = q.to(dtype).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, max(lengths), num_splits=num_splits)
    expected = paged_decode_attention_reference(
        q.cpu(), k_cache.to("cpu"), v_cache.to("cpu"), tables.cpu(), lens.cpu()
    )
    assert_close(out, expected, dtype)
    with pytest.raises(ValueError, match="k_cache: the K and V caches must both be int8"):
        paged_decode_attention(q, k_cache, dense_v, tables, lens, max(lengths))


def test_decode_attention_launcher_checks_its_arguments() -> None:
    k_cache, v_cache, tables = random_cache([5], 16, 2, 64, torch.float32, seed=0)
    q = torch.randn(1, 4, 64, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_cache: expected dtype torch\.bfloat16"):
        paged_decode_attention(q.bfloat16(), k_cache, v_cache, tables, lens, 5)
    with pytest.raises(ValueError, match="block_tables: expected dtype in"):
        paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 5)
    with pytest.raises(ValueError, match="q: expected a contiguous tensor"):
        paged_decode_attention(q.transpose(1, 2), k_cache, v_cache, tables, lens, 5)
    with pytest.raises(ValueError, match="q: expected a multiple of 2 heads"):
        paged_decode_attention(q[:, :3].contiguous(), k_cache, v_cache, tables, lens, 5)
    with pytest.raises(ValueError, match="block_tables: expected room for 100 tokens"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 100)


# ------------------------------------------------------------------------------------ prefill


def prefill_queries(
    chunks: list[tuple[int, int]], num_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For chunks of (tokens cached, chunk length): their queries back to back, where each starts,
    and each sequence's context length."""
    starts = [0]
    for _, length in chunks:
        starts.append(starts[-1] + length)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    contexts = [cached + length for cached, length in chunks]
    return (
        q.to(dtype).to(DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group"), [(16, 3, 3), (8, 1, 8), (32, 2, 1)])
def test_prefill_attention_matches_reference_over_mixed_chunks(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int
) -> None:
    b = block_size
    # (tokens already cached, chunk length): fresh prompts, cached prefixes ending mid-block and
    # on a block boundary, a one-token chunk, a chunk spanning several query tiles.
    chunks = [(0, 1), (0, b + 1), (b, 5), (7, 2 * b - 1), (2 * b, 33), (3, 1)]
    contexts = [cached + length for cached, length in chunks]
    head_dim = 32
    k_cache, v_cache, tables = random_cache(contexts, b, num_kv_heads, head_dim, dtype, seed=b * group)
    q, query_start, lens = prefill_queries(chunks, num_kv_heads * group, head_dim, dtype, seed=3)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, query_start, lens, max(c for _, c in chunks))
    expected = paged_prefill_attention_reference(
        q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), query_start.cpu(), lens.cpu()
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_an_int8_cache(dtype: torch.dtype) -> None:
    b, num_kv_heads, group, head_dim = 16, 2, 3, 32
    chunks = [(0, b + 1), (7, 2 * b - 1), (2 * b, 5)]
    contexts = [cached + length for cached, length in chunks]
    dense_k, dense_v, tables = random_cache(contexts, b, num_kv_heads, head_dim, dtype, seed=11)
    k_cache, v_cache = quantize_cache(dense_k.cpu()).to(DEVICE), quantize_cache(dense_v.cpu()).to(DEVICE)
    q, query_start, lens = prefill_queries(chunks, num_kv_heads * group, head_dim, dtype, seed=5)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, query_start, lens, max(c for _, c in chunks))
    expected = paged_prefill_attention_reference(
        q.cpu(), k_cache.to("cpu"), v_cache.to("cpu"), tables.cpu(), query_start.cpu(), lens.cpu()
    )
    assert_close(out, expected, dtype)


# ------------------------------------------------------------------------------------ compiles

ATTENTION_KERNELS = [_decode_split_kernel, _decode_reduce_kernel, _prefill_kernel]
METADATA_POINTERS = {"block_tables_ptr", "context_lens_ptr", "query_start_ptr"}


def unspecialized(kernel: object) -> set[str]:
    """The arguments Triton compiles no variants for: from the JIT function's parameters on a GPU,
    from the interpreter's copy of the decorator's arguments on the CPU."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return {p.name for p in params if p.do_not_specialize}
    return set(getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())


@pytest.mark.parametrize("kernel", ATTENTION_KERNELS, ids=lambda k: k.fn.__name__)
def test_attention_kernels_take_each_steps_numbers_unspecialized(kernel: object) -> None:
    # Every runtime integer (not a pointer, not the float scale) changes from step to step: the
    # table width, tokens per split, the split count. So does where the metadata arrays start: a
    # step's prefills read theirs from a row into the step's. Specialized, each new value class
    # or alignment would compile a variant in the middle of serving.
    fn = kernel.fn  # type: ignore[attr-defined]
    names = list(inspect.signature(fn).parameters)
    annotations = fn.__annotations__
    per_step = {
        name
        for name in names
        if (
            not name.endswith("_ptr")
            and name != "scale"
            and "constexpr" not in str(annotations.get(name, ""))
        )
        or name in METADATA_POINTERS
    }
    assert per_step, f"{fn.__name__} has no per-step arguments to check"
    assert per_step <= unspecialized(kernel), (
        f"{fn.__name__}: specialized on {per_step - unspecialized(kernel)}"
    )
    assert not any(name.removeprefix("NUM_") == "SPLITS" for name in names), "a split count as a constexpr"


def compiled_variants(kernel: object) -> int:
    """How many variants the JIT function has compiled, over every device (Triton keeps one cache
    of compiled kernels per device, the first item of its entry)."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())  # type: ignore[attr-defined]


@pytest.mark.gpu
def test_steps_of_any_size_reuse_the_attention_kernels_compiled_for_the_first() -> None:
    # The steps a server meets: batch sizes 1 to 64, contexts from 1 token to thousands, block
    # tables 1, 16, 17 and 250 blocks wide, split counts from 1 to 64. The split and prefill
    # kernels compile once; the reduce once per power of two of splits it pads to.
    b, kv_heads, group, head_dim = 16, 3, 3, 64
    dtype = torch.bfloat16
    shapes = [(1, 1), (3, 40), (2, 16 * b), (5, 17 * b - 3), (64, 700), (1, 250 * b)]
    paddings = set()
    before = [compiled_variants(k) for k in ATTENTION_KERNELS]
    for num_seqs, context in shapes:
        lengths = [max(1, context - i) for i in range(num_seqs)]
        k_cache, v_cache, tables = random_cache(lengths, b, kv_heads, head_dim, dtype, seed=num_seqs)
        tables = tables[:, : -(-context // b)].contiguous()  # exactly as wide as the longest
        lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        q = torch.randn(num_seqs, kv_heads * group, head_dim, device=DEVICE, dtype=dtype)
        paged_decode_attention(q, k_cache, v_cache, tables, lens, context)
        programs = 4 * torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = decode_splits(context, b, num_seqs, kv_heads, programs)
        paddings.add(max(2, 1 << (splits - 1).bit_length()))
        starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
        q_all = torch.randn(int(starts[-1]), kv_heads * group, head_dim, device=DEVICE, dtype=dtype)
        paged_prefill_attention(q_all, k_cache, v_cache, tables, starts, lens, max(lengths))
        # A step's prefills behind its decodes: their metadata starts a row into the batch's.
        skip = min(1, num_seqs - 1)
        paged_prefill_attention(
            q_all[lengths[0] :] if skip else q_all,
            k_cache,
            v_cache,
            tables[skip:],
            starts[skip:] - starts[skip],
            lens[skip:],
            max(lengths),
        )
    torch.cuda.synchronize()
    added = [compiled_variants(k) - n for k, n in zip(ATTENTION_KERNELS, before, strict=True)]
    assert len(paddings) > 2, f"the shapes took only split paddings {paddings}"
    assert added[0] <= 1 and added[2] <= 1, f"variants compiled (split, reduce, prefill): {added}"
    assert added[1] <= len(paddings), f"reduce variants {added[1]} for paddings {sorted(paddings)}"


# ------------------------------------------------------------------------------------ KV write


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_stores_each_token_at_its_slot_and_skips_padding(dtype: torch.dtype) -> None:
    num_kv_heads, head_dim, block_size = 3, 16, 8
    qkv = torch.randn(6, (4 + 2 * num_kv_heads) * head_dim).to(dtype).to(DEVICE)  # q of 4 heads, then k, v
    k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(6, num_kv_heads, head_dim)
    v = qkv[:, (4 + num_kv_heads) * head_dim :].view(6, num_kv_heads, head_dim)
    slots = torch.tensor([0, 7, 8, -1, 23, 9], device=DEVICE)  # block boundaries, and one padding token
    caches = [
        torch.zeros(3, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)
    ]
    write_kv(k, v, caches[0], caches[1], slots)
    write_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, num_kv_heads, head_dim)[[1, 2, 3, 4, 5, 6]].abs().sum() == 0  # untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_into_an_int8_cache_equals_its_definition_bit_for_bit(dtype: torch.dtype) -> None:
    """Each row quantized (ties to even, an all-zero row, a huge value), slot -1 skipped."""
    num_kv_heads, head_dim, block_size = 3, 16, 8
    qkv = (torch.randn(7, (4 + 2 * num_kv_heads) * head_dim) * 3).to(dtype)
    qkv[0, 4 * head_dim : 5 * head_dim] = 0.0  # token 0's first K row: zeros, scale 0
    qkv[1, 4 * head_dim : 4 * head_dim + 2] = torch.tensor([2.0, 1.0])  # 1 * 127 / 2 = 63.5: a tie
    qkv[1, 4 * head_dim + 2 : 5 * head_dim] = 0.5
    qkv[2, 5 * head_dim] = 6e4  # the rest of its row rounds to 0
    qkv = qkv.to(DEVICE)
    k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(7, num_kv_heads, head_dim)
    v = qkv[:, (4 + num_kv_heads) * head_dim :].view(7, num_kv_heads, head_dim)
    slots = torch.tensor([0, 7, 8, -1, 23, 9, 16], device=DEVICE)
    ours = [Int8Cache.zeros(3, block_size, num_kv_heads, head_dim, DEVICE) for _ in range(2)]
    theirs = [Int8Cache.zeros(3, block_size, num_kv_heads, head_dim, "cpu") for _ in range(2)]
    write_kv(k, v, ours[0], ours[1], slots)
    write_kv_int8(theirs[0], theirs[1], k.cpu(), v.cpu(), slots.cpu())
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine.values.cpu(), reference.values)
        assert torch.equal(mine.scales.cpu(), reference.scales)
    assert int(ours[0].values[0, 7, 0, 0]) == 127 and int(ours[0].values[0, 7, 0, 1]) == 64  # 63.5 to even
    with pytest.raises(ValueError, match="k_cache: the K and V caches must both be int8"):
        write_kv(
            k,
            v,
            ours[0],
            torch.zeros(3, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE),
            slots,
        )


# ------------------------------------------------------------------------------------ fused elementwise


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (5, 576), (3, 1000)])
def test_fused_add_rms_norm_matches_the_model(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    expected_residual = residual.clone()
    expected = fused_add_rms_norm_reference(x, expected_residual, weight, 1e-5)
    out = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_close(residual, expected_residual, dtype)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "ffn"), [(1, 8), (4, 1536), (2, 1100)])
def test_silu_and_mul_matches_the_model(dtype: torch.dtype, tokens: int, ffn: int) -> None:
    gate_up = (
        (torch.randn(tokens, 2 * ffn, generator=torch.Generator().manual_seed(ffn)) * 3).to(dtype).to(DEVICE)
    )
    assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), dtype)


LLAMA3 = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_rotary_embedding_rotates_q_and_k_in_place_like_the_model(
    dtype: torch.dtype, scaling: Llama3RopeScaling | None
) -> None:
    head_dim, heads, kv_heads = 64, 4, 2
    config = ModelConfig(
        name="t",
        vocab_size=10,
        hidden_size=heads * head_dim,
        intermediate_size=8,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        context_length=8192,
        rope_scaling=scaling,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    inv_freq = rope_inv_freq(config).to(DEVICE)
    positions = torch.tensor([0, 1, 15, 16, 1000, 8191], device=DEVICE)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(5))
    qkv = qkv.to(dtype).to(DEVICE)
    q = qkv[:, : heads * head_dim].view(6, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(6, kv_heads, head_dim)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_reference(q_ref, k_ref, positions, inv_freq)
    rotary_embedding(q, k, positions, inv_freq)
    # Angles up to 8191 rad: float32 cos/sin of Triton and torch may differ by a few ulp before rounding.
    tolerance = max(TOLERANCE[dtype], 1e-4)
    torch.testing.assert_close(q.float().cpu(), q_ref.float().cpu(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k.float().cpu(), k_ref.float().cpu(), atol=tolerance, rtol=tolerance)
    assert math.isfinite(float(q.float().abs().max()))

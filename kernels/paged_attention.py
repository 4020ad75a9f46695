"""Paged attention in Triton: decode (split-K over long contexts) and chunked prefill, with torch references.

Cache layout, per layer: [num_blocks, block_size, num_kv_heads, head_dim], contiguous; slot s
is block s // block_size, offset s % block_size. Query head h reads KV head h // G, G =
num_heads // num_kv_heads. A step writes its own K/V into the cache first (kernels.fused_ops.write_kv),
so both kernels read every key, cached prefix and new tokens alike, from the cache. An int8
cache (`--kv-cache-dtype int8`, kernels/kv_int8.py) is read as its rows times their scales
([num_blocks, num_kv_heads, block_size] float32), in float32, then as the query's dtype where
the dot products take it.

Every number that changes from step to step (table width, tokens per split, split count) is a
runtime argument that Triton does not specialize on, and so are the metadata arrays (block
tables, context lengths, query starts), which a step's prefills read from a row into the step's
own. Specialized, each new integer class (1, a multiple of 16, other), split count or pointer
alignment would compile a kernel variant the first time a step met it, tenths of a second on a
GPU in the latency of that step's requests. The split and prefill kernels compile once, in the
worker's warm-up; the reduce kernel once per power of two it pads the splits to (six at most),
which the capture of the decode graphs meets.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._launch import dot_in_fp32, dot_precision, next_power_of_2, require, require_tensor
from kernels.cpu_decode import gather_context
from kernels.cpu_decode import paged_decode_attention_reference as cpu_decode_reference
from kernels.kv_int8 import Int8Cache, int8_pair


def cache_parts(
    q: torch.Tensor, k_cache: torch.Tensor | Int8Cache, v_cache: torch.Tensor | Int8Cache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(K rows, V rows, K scales, V scales, int8?) after checking the caches' kinds and dtypes; a
    dense cache's scale pointers are its rows (the kernels do not read them)."""
    if isinstance(k_cache, Int8Cache) or isinstance(v_cache, Int8Cache):
        k_cache, v_cache = int8_pair(k_cache, v_cache)
        require(k_cache.values.device == q.device, "k_cache", k_cache.values, f"on {q.device} like q")
        return k_cache.values, v_cache.values, k_cache.scales, v_cache.scales, True
    require_tensor(k_cache, "k_cache", dims=4)
    require_tensor(v_cache, "v_cache", dims=4)
    require(v_cache.shape == k_cache.shape, "v_cache", v_cache, f"shape {tuple(k_cache.shape)}")
    require(k_cache.dtype == q.dtype == v_cache.dtype, "k_cache", k_cache, f"dtype {q.dtype} like q")
    return k_cache, v_cache, k_cache, v_cache, False


# ------------------------------------------------------------------------------------ decode

DECODE_TILE = 64  # keys per iteration of the decode kernel (several blocks gathered at once)


@triton.jit(do_not_specialize=["block_tables_ptr", "context_lens_ptr", "max_blocks", "tokens_per_split"])
def _decode_split_kernel(
    q_ptr,  # [N, H, D]
    k_cache_ptr,  # [num_blocks, BS, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # KV_INT8: [num_blocks, Hkv, BS] float32
    v_scale_ptr,
    block_tables_ptr,  # [N, max_blocks] int32
    context_lens_ptr,  # [N] int32
    part_max_ptr,  # [N, H, S] float32
    part_sum_ptr,  # [N, H, S] float32
    part_out_ptr,  # [N, H, S, D] float32
    scale,
    max_blocks,
    tokens_per_split,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # keys per iteration, gathered from TILE / BLOCK_SIZE blocks
    USE_DOT: tl.constexpr,  # the group's query heads times the keys on the tensor cores
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    group_ok = groups < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + groups  # [G]

    q = tl.load(
        q_ptr + (seq * NUM_HEADS + heads)[:, None] * HEAD_DIM + dims[None, :],
        mask=group_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [G, D]; padding rows are zero and never stored
    if DOT_FP32 or not USE_DOT:
        q = q.to(tl.float32)

    context = tl.load(context_lens_ptr + seq)
    first = split * tokens_per_split
    last = tl.minimum(first + tokens_per_split, context)

    running_max = tl.full([GROUP_PAD], -float("inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for start in range(first, last, TILE):
        positions = start + tl.arange(0, TILE)  # [TILE]
        valid = positions < last
        blocks = tl.load(block_tables_ptr + seq * max_blocks + positions // BLOCK_SIZE, mask=valid, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        offsets = (slots * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=mask, other=0)  # [TILE, D]
        v = tl.load(v_cache_ptr + offsets, mask=mask, other=0)
        if KV_INT8:
            at = (blocks.to(tl.int64) * NUM_KV_HEADS + kv_head) * BLOCK_SIZE + positions % BLOCK_SIZE
            k = k.to(tl.float32) * tl.load(k_scale_ptr + at, mask=valid, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(v_scale_ptr + at, mask=valid, other=0.0)[:, None]
            if USE_DOT and not DOT_FP32:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        if DOT_FP32 or not USE_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, TILE]
        else:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(valid[None, :], scores, -float("inf"))
        block_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: the tile has a valid key
        rescale = tl.exp(running_max - block_max)
        probs = tl.exp(scores - block_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        if USE_DOT:
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        else:
            acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = block_max

    part = (seq * NUM_HEADS + heads) * tl.num_programs(2) + split  # [G]: the grid's third axis is the splits
    tl.store(part_max_ptr + part, running_max, mask=group_ok)
    tl.store(part_sum_ptr + part, running_sum, mask=group_ok)
    tl.store(
        part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=group_ok[:, None] & dim_ok[None, :]
    )


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_out_ptr,
    out_ptr,  # [N, H, D]
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < num_splits
    base = (seq * NUM_HEADS + head) * num_splits
    maxes = tl.load(part_max_ptr + base + splits, mask=split_ok, other=-float("inf"))
    sums = tl.load(part_sum_ptr + base + splits, mask=split_ok, other=0.0)
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    overall = tl.max(maxes, axis=0)
    # Splits past a short context saw no key: max -inf, sum 0; their weight is exp(-inf) = 0.
    weights = tl.where(maxes == -float("inf"), 0.0, tl.exp(maxes - overall))
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(weights[:, None] * parts, axis=0) / total
    tl.store(
        out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.cache
def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(
    max_context: int, block_size: int, num_seqs: int, num_kv_heads: int, target_programs: int
) -> int:
    """Splits per sequence so that num_seqs * num_kv_heads * splits reaches `target_programs`,
    with at least 4 blocks per split (fewer would cost more in the reduce than they save)."""
    blocks = -(-max_context // block_size)
    wanted = -(-target_programs // max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, blocks // 4, 64))


def paged_decode_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor | Int8Cache,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | Int8Cache,
    block_tables: torch.Tensor,  # [N, max_blocks] int32
    context_lens: torch.Tensor,  # [N] int32, each >= 1
    max_context: int,
    num_splits: int | None = None,
) -> torch.Tensor:  # [N, H, D], like q
    """One query token per sequence against its paged context; split-K when there are few sequences."""
    require_tensor(q, "q", dims=3)
    k_rows, v_rows, k_scales, v_scales, kv_int8 = cache_parts(q, k_cache, v_cache)
    require_tensor(block_tables, "block_tables", dims=2, dtypes=(torch.int32,))
    require_tensor(context_lens, "context_lens", dims=1, dtypes=(torch.int32,))
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_rows.shape
    require(cache_dim == head_dim, "k_cache", k_rows, f"head_dim {head_dim} like q")
    require(num_heads % num_kv_heads == 0, "q", q, f"a multiple of {num_kv_heads} heads")
    require(block_tables.shape[0] == num_seqs, "block_tables", block_tables, f"{num_seqs} rows")
    require(context_lens.shape[0] == num_seqs, "context_lens", context_lens, f"{num_seqs} entries")
    require(
        block_tables.shape[1] * block_size >= max_context,
        "block_tables",
        block_tables,
        f"room for {max_context} tokens",
    )
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        programs = 4 * _multiprocessors(q.device.index) if q.is_cuda else 8
        num_splits = decode_splits(max_context, block_size, num_seqs, num_kv_heads, programs)
    blocks = -(-max_context // block_size)
    blocks_per_split = -(-blocks // num_splits)
    use_dot = head_dim >= 16  # tl.dot needs 16 along every side: the group is padded to 16 rows
    part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    head_dim_pad = next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_rows,
        v_rows,
        k_scales,
        v_scales,
        block_tables,
        context_lens,
        part_max,
        part_sum,
        part_out,
        head_dim**-0.5,
        block_tables.shape[1],
        blocks_per_split * block_size,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16 if use_dot else 2, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE=max(block_size, DECODE_TILE),
        USE_DOT=use_dot,
        DOT_FP32=dot_in_fp32(),
        PRECISION=dot_precision(q.dtype),
        KV_INT8=kv_int8,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_max,
        part_sum,
        part_out,
        out,
        num_splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=max(2, next_power_of_2(num_splits)),
    )
    return out


# The Triton and C decode kernels are tested against one definition.
paged_decode_attention_reference = cpu_decode_reference


# ------------------------------------------------------------------------------------ prefill


@triton.jit(do_not_specialize=["block_tables_ptr", "query_start_ptr", "context_lens_ptr", "max_blocks"])
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # KV_INT8: [num_blocks, Hkv, BS] float32
    v_scale_ptr,
    block_tables_ptr,  # [N, max_blocks] int32
    query_start_ptr,  # [N + 1] int32
    context_lens_ptr,  # [N] int32
    out_ptr,  # [T, H, D]
    scale,
    max_blocks,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    context = tl.load(context_lens_ptr + seq)
    cached = context - q_len  # tokens before this chunk
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] index within the chunk
    row_ok = rows < q_len
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + ((q_start + rows) * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    query_pos = cached + rows  # [M]

    running_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    end = tl.minimum(context, cached + (tile + 1) * BLOCK_M)  # the last row's causal horizon
    for start in range(0, end, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)  # [N]
        key_ok = key_pos < end
        blocks = tl.load(block_tables_ptr + seq * max_blocks + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + key_pos % BLOCK_SIZE
        offsets = (slots * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=mask, other=0)
        v = tl.load(v_cache_ptr + offsets, mask=mask, other=0)
        if KV_INT8:
            at = (blocks.to(tl.int64) * NUM_KV_HEADS + kv_head) * BLOCK_SIZE + key_pos % BLOCK_SIZE
            k = k.to(tl.float32) * tl.load(k_scale_ptr + at, mask=key_ok, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(v_scale_ptr + at, mask=key_ok, other=0.0)[:, None]
            if not DOT_FP32:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_ok[None, :]
        scores = tl.where(visible, scores, -float("inf"))
        block_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # Rows past the chunk see no key at all; keep their max finite so no NaN appears.
        block_max = tl.where(block_max == -float("inf"), 0.0, block_max)
        rescale = tl.exp(running_max - block_max)
        probs = tl.exp(scores - block_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        running_max = block_max
    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(
        out_ptr + ((q_start + rows) * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: every sequence's chunk, back to back
    k_cache: torch.Tensor | Int8Cache,
    v_cache: torch.Tensor | Int8Cache,
    block_tables: torch.Tensor,  # [N, max_blocks] int32
    query_start_loc: torch.Tensor,  # [N + 1] int32
    context_lens: torch.Tensor,  # [N] int32: cached tokens + chunk length
    max_query_len: int,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:  # [T, H, D]
    """Chunks of different lengths in one launch: causal within each chunk, full attention to its cached prefix."""
    require_tensor(q, "q", dims=3)
    k_rows, v_rows, k_scales, v_scales, kv_int8 = cache_parts(q, k_cache, v_cache)
    require_tensor(block_tables, "block_tables", dims=2, dtypes=(torch.int32,))
    require_tensor(query_start_loc, "query_start_loc", dims=1, dtypes=(torch.int32,))
    require_tensor(context_lens, "context_lens", dims=1, dtypes=(torch.int32,))
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_rows.shape
    num_seqs = context_lens.shape[0]
    require(
        cache_dim == head_dim and head_dim >= 16, "k_cache", k_rows, f"head_dim {head_dim} (>= 16) like q"
    )
    require(num_heads % num_kv_heads == 0, "q", q, f"a multiple of {num_kv_heads} heads")
    require(
        query_start_loc.shape[0] == num_seqs + 1,
        "query_start_loc",
        query_start_loc,
        f"{num_seqs + 1} entries",
    )
    require(block_tables.shape[0] == num_seqs, "block_tables", block_tables, f"{num_seqs} rows")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    grid = (num_seqs, -(-max_query_len // block_m), num_heads)
    _prefill_kernel[grid](
        q,
        k_rows,
        v_rows,
        k_scales,
        v_scales,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        head_dim**-0.5,
        block_tables.shape[1],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=dot_in_fp32(),
        PRECISION=dot_precision(q.dtype),
        KV_INT8=kv_int8,
    )
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor | Int8Cache,
    v_cache: torch.Tensor | Int8Cache,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """Per sequence: gather its keys and values from the cache, causal mask offset by the cached prefix."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    for n in range(context_lens.shape[0]):
        start, end = int(query_start_loc[n]), int(query_start_loc[n + 1])
        context = int(context_lens[n])
        cached = context - (end - start)
        keys, values = gather_context(k_cache, v_cache, block_tables[n], context, num_heads)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * head_dim**-0.5
        visible = torch.arange(context)[None, :] <= (cached + torch.arange(end - start))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out

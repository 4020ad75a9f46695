"""Prefill attention on the CPU: torch SDPA runs whole prompts of one length as one call; the CPU
backend sends every prefill chunk to the C prefill kernel in one call."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from gpu_worker.attention import CpuPagedAttention, TorchPagedAttention, fresh_runs
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from kernels.cpu_decode import load_cpu_decode_attention
from kernels.cpu_prefill import CpuPrefillAttention, load_prefill_attention
from tests.cpu_features import cpu_has, has_avx2_fma

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 32, 8


def chunk(length: int, start: int, blocks: list[int]) -> ScheduledChunk:
    return ScheduledChunk(list(range(3, 3 + length)), start, blocks, True)


# Three whole 5-token prompts (one run), a 3-token one, a chunk behind a cached prefix of 9, a
# decode, then two more 5-token prompts (another run).
CHUNKS = [
    chunk(5, 0, [0]),
    chunk(5, 0, [1]),
    chunk(5, 0, [2]),
    chunk(3, 0, [3]),
    chunk(4, 9, [4, 5]),
    chunk(1, 12, [6, 7]),
    chunk(5, 0, [8]),
    chunk(5, 0, [9]),
]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Query i of the chunk attends to keys 0..P+i, for the last len(q) of the P + len(q) keys."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * HEAD_DIM**-0.5
    visible = torch.ones(len(q), len(k), dtype=torch.bool).tril(len(k) - len(q))
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


def random_step(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """A 12-block cache and one step's q, k, v for CHUNKS' tokens, in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(len(c.token_ids) for c in CHUNKS)
    shapes = [(12, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)] * 2 + [(tokens, NUM_HEADS, HEAD_DIM)]
    shapes += [(tokens, NUM_KV_HEADS, HEAD_DIM)] * 2
    return tuple(torch.randn(*shape, generator=gen).to(dtype) for shape in shapes)


class CountedCalls:
    """The real prefill kernel, recording the plan of each call."""

    def __init__(self, kernel: CpuPrefillAttention) -> None:
        self.kernel = kernel
        self.dtype = kernel.dtype
        self.plans: list[Any] = []

    def __call__(self, *args: Any) -> torch.Tensor:
        self.plans.append(args[3])
        return self.kernel(*args)


def test_runs_group_adjacent_whole_prompts_of_one_length() -> None:
    batch = build_forward_batch(CHUNKS, BLOCK_SIZE, "cpu")
    runs = fresh_runs(batch.prefills)
    assert [len(run) for run in runs] == [3, 1, 1, 2]
    assert [chunk.num_tokens for run in runs for chunk in run] == [5, 5, 5, 3, 4, 5, 5]


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_run_gives_each_prompt_its_own_bits(dtype: torch.dtype, tolerance: float) -> None:
    k_cache, v_cache, q, k, v = random_step(dtype, seed=0)
    batch = build_forward_batch(CHUNKS, BLOCK_SIZE, "cpu")
    tokens = batch.num_tokens
    attention = TorchPagedAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    together = attention(q, k, v, (k_cache.clone(), v_cache.clone()), batch).view(tokens, NUM_HEADS, HEAD_DIM)
    prompts = [c for c in CHUNKS if len(c.token_ids) > 1]  # the batch's prefills, in order
    assert len(prompts) == len(batch.prefills) == 7
    for prompt, prefill in zip(prompts, batch.prefills, strict=True):
        rows = slice(prefill.token_start, prefill.token_start + prefill.num_tokens)
        # The same chunk alone in a batch of its own: the same bits.
        alone_batch = build_forward_batch([prompt], BLOCK_SIZE, "cpu")
        alone = attention(q[rows], k[rows], v[rows], (k_cache.clone(), v_cache.clone()), alone_batch)
        assert torch.equal(alone.view(-1, NUM_HEADS, HEAD_DIM), together[rows])
        # Against the reference, the cached prefix (if any) read from the cache as written.
        slots = [b * BLOCK_SIZE + i for b in prompt.block_table for i in range(BLOCK_SIZE)][
            : prompt.start_position
        ]
        keys = torch.cat([k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], k[rows]])
        values = torch.cat([v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], v[rows]])
        expected = reference(q[rows], keys, values)
        torch.testing.assert_close(together[rows].double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [
        pytest.param(
            torch.bfloat16,
            2e-2,
            marks=pytest.mark.skipif(not cpu_has("avx512_bf16"), reason="this CPU has no AVX-512 BF16"),
        ),
        pytest.param(
            torch.float32,
            1e-5,
            marks=pytest.mark.skipif(not has_avx2_fma(), reason="this CPU has no AVX2 and FMA"),
        ),
    ],
)
def test_the_cpu_backend_sends_every_prefill_chunk_to_the_prefill_kernel_in_one_call(
    dtype: torch.dtype, tolerance: float
) -> None:
    k_cache, v_cache, q, k, v = random_step(dtype, seed=1)
    batch = build_forward_batch(CHUNKS, BLOCK_SIZE, "cpu")
    tokens = batch.num_tokens
    decode = load_cpu_decode_attention(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS, BLOCK_SIZE, dtype)
    counted = CountedCalls(load_prefill_attention(HEAD_DIM, dtype=dtype))
    calls = counted.plans
    with_kernel = CpuPagedAttention(
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, decode, prefill_kernel=cast(CpuPrefillAttention, counted)
    )
    without = CpuPagedAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, decode)
    cache = (k_cache.clone(), v_cache.clone())
    ours = with_kernel(q, k, v, cache, batch).view(tokens, NUM_HEADS, HEAD_DIM)
    theirs = without(q, k, v, (k_cache.clone(), v_cache.clone()), batch).view(tokens, NUM_HEADS, HEAD_DIM)
    assert len(calls) == 1
    plan = calls[0]
    assert plan.table[:2].T.tolist() == [[p.token_start, p.num_tokens] for p in batch.prefills]
    assert (plan.table[2] > 0).sum() == 1  # the chunk behind a prefix of 9
    # A second layer of the same step reuses the plan.
    with_kernel(q, k, v, (k_cache.clone(), v_cache.clone()), batch)
    assert len(calls) == 2 and calls[1] is plan
    for chunk in batch.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        if chunk.key_slots is None:
            keys, values = k[rows], v[rows]
        else:  # its keys as the cache holds them after this step's write
            keys = cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[chunk.key_slots]
            values = cache[1].view(-1, NUM_KV_HEADS, HEAD_DIM)[chunk.key_slots]
        expected = reference(q[rows], keys, values)
        torch.testing.assert_close(ours[rows].double(), expected, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(ours[rows], theirs[rows], atol=tolerance, rtol=tolerance)
    assert batch.decode is not None
    assert torch.equal(ours[: batch.decode.num_seqs], theirs[: batch.decode.num_seqs])

"""The CPU prefill attention against a float64 reference, with and without a cached prefix, on each
engine this CPU runs (AVX-512 BF16 dot products; AMX tiles too where the CPU has them), and its
launcher's checks."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_build import AMX, KernelBuildError
from kernels.cpu_prefill import Chunk, CpuPrefillAttention, load_prefill_attention, plan_chunks
from tests.cpu_features import cpu_has, engines_here

# Only a CPU without AVX-512 BF16 cannot run the kernel; anywhere else a build failure fails here.
pytestmark = pytest.mark.skipif(not cpu_has("avx512_bf16"), reason="this CPU has no AVX-512 BF16")


@pytest.fixture(params=engines_here())
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def load_on(engine: str, head_dim: int) -> CpuPrefillAttention:
    """The kernel on `engine`, checked to be the one that runs."""
    kernel = load_prefill_attention(head_dim, allow_amx=engine == AMX)
    assert kernel.engine == engine
    return kernel


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention in float64 of a chunk's queries to its P + len(q) keys: query i sees keys 0..P+i."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * q.shape[2] ** -0.5
    visible = torch.ones(len(q), len(k), dtype=torch.bool).tril(len(k) - len(q))
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


def projections(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model has them: views into one [T, (H + 2 Hkv) * Dh] projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize(
    "lengths", [[1], [2], [15], [16], [17], [31], [32], [33], [64], [100, 7, 1, 300], [256] * 4]
)
def test_each_prompt_attends_causally_to_itself(
    engine: str, head_dim: int, heads: int, kv_heads: int, lengths: list[int]
) -> None:
    kernel = load_on(engine, head_dim)
    gap = 3  # rows between prompts that no prompt owns: the kernel must leave them alone
    starts = [sum(lengths[:i]) + gap * (i + 1) for i in range(len(lengths))]
    tokens = starts[-1] + lengths[-1] + gap
    q, k, v = projections(tokens, heads, kv_heads, head_dim, seed=sum(lengths) + heads)
    out = torch.full((tokens, heads, head_dim), 7.0).bfloat16()
    plan = plan_chunks([Chunk(s, n) for s, n in zip(starts, lengths, strict=True)])
    assert kernel(q, k, v, plan, out) is out
    owned = torch.zeros(tokens, dtype=torch.bool)
    for start, length in zip(starts, lengths, strict=True):
        rows = slice(start, start + length)
        owned[rows] = True
        expected = reference(q[rows], k[rows], v[rows])
        # Probabilities and outputs round to bfloat16 once each; sums are float32.
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-2, rtol=2e-2)
        assert (out[rows].double() - expected).abs().mean() < 2e-3
    assert torch.equal(out[~owned], torch.full_like(out[~owned], 7.0))


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize(
    ("prefix", "length"), [(1, 1), (1, 16), (15, 2), (16, 16), (17, 33), (250, 6), (300, 100)]
)
def test_a_chunk_behind_a_prefix_reads_its_keys_from_the_cache(
    engine: str, head_dim: int, heads: int, kv_heads: int, prefix: int, length: int
) -> None:
    kernel = load_on(engine, head_dim)
    block_size, num_blocks = 16, 64
    gen = torch.Generator().manual_seed(prefix * length + heads)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    # A whole prompt first, then the chunk: its keys at scattered slots, its own written there.
    q, k, v = projections(20 + length, heads, kv_heads, head_dim, seed=prefix)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: prefix + length]
    rows = slice(20, 20 + length)
    k_cache.view(-1, kv_heads, head_dim)[slots[prefix:]] = k[rows]
    v_cache.view(-1, kv_heads, head_dim)[slots[prefix:]] = v[rows]
    out = kernel(
        q,
        k,
        v,
        plan_chunks([Chunk(0, 20), Chunk(20, length, slots)]),
        torch.empty_like(q).contiguous(),
        (k_cache, v_cache),
    )
    keys = k_cache.view(-1, kv_heads, head_dim)[slots]
    values = v_cache.view(-1, kv_heads, head_dim)[slots]
    expected = reference(q[rows], keys, values)
    torch.testing.assert_close(out[rows].double(), expected, atol=2e-2, rtol=2e-2)
    assert (out[rows].double() - expected).abs().mean() < 2e-3
    torch.testing.assert_close(out[:20].double(), reference(q[:20], k[:20], v[:20]), atol=2e-2, rtol=2e-2)


def test_a_prompt_gives_the_same_bits_alone_and_among_others(engine: str) -> None:
    kernel = load_on(engine, 64)
    q, k, v = projections(90, 9, 3, 64, seed=1)
    together = kernel(
        q, k, v, plan_chunks([Chunk(0, 40), Chunk(40, 50)]), torch.empty(90, 9, 64, dtype=torch.bfloat16)
    )
    alone = kernel(
        q[40:], k[40:], v[40:], plan_chunks([Chunk(0, 50)]), torch.empty(50, 9, 64, dtype=torch.bfloat16)
    )
    assert torch.equal(together[40:], alone)


def test_no_prompts_write_nothing(engine: str) -> None:
    kernel = load_on(engine, 64)
    q, k, v = projections(4, 9, 3, 64, seed=2)
    out = torch.zeros(4, 9, 64, dtype=torch.bfloat16)
    assert torch.equal(kernel(q, k, v, plan_chunks([]), out), torch.zeros(4, 9, 64, dtype=torch.bfloat16))


def test_other_head_dims_are_refused_at_load() -> None:
    with pytest.raises(KernelBuildError, match="head_dim"):
        load_prefill_attention(128)


def test_the_launcher_names_what_it_cannot_take(engine: str) -> None:
    kernel = load_on(engine, 64)
    q, k, v = projections(8, 9, 3, 64, seed=3)
    out = torch.empty(8, 9, 64, dtype=torch.bfloat16)
    prompts = plan_chunks([Chunk(0, 8)])
    with pytest.raises(ValueError, match=r"^q: "):
        kernel(q.float(), k, v, prompts, out)
    with pytest.raises(ValueError, match=r"^q: "):
        kernel(q[..., :32], k, v, prompts, out)
    with pytest.raises(ValueError, match=r"^k: "):
        kernel(q, k[:, :2], v, prompts, out)
    with pytest.raises(ValueError, match=r"^v: "):
        kernel(q, k, v[:4], prompts, out)
    with pytest.raises(ValueError, match=r"^v: "):
        kernel(q, k, v.transpose(0, 1).contiguous().transpose(0, 1), prompts, out)
    with pytest.raises(ValueError, match=r"^out: "):
        kernel(q, k, v, prompts, out[:7])
    with pytest.raises(ValueError, match=r"^plan: "):
        kernel(q, k, v, plan_chunks([Chunk(4, 5)]), out)
    with pytest.raises(ValueError, match=r"^chunks: "):
        plan_chunks([Chunk(0, 0)])
    with pytest.raises(ValueError, match=r"^chunks: "):
        plan_chunks([Chunk(-1, 3)])
    cache = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    behind = plan_chunks([Chunk(0, 8, torch.arange(10))])
    with pytest.raises(ValueError, match=r"^kv_cache: "):
        kernel(q, k, v, behind, out)
    with pytest.raises(ValueError, match=r"^k_cache: "):
        kernel(q, k, v, behind, out, (cache.float(), cache))
    with pytest.raises(ValueError, match=r"^v_cache: "):
        kernel(q, k, v, behind, out, (cache, cache[:2]))
    for slots in (torch.arange(8), torch.arange(10).int(), torch.arange(-1, 9)):
        with pytest.raises(ValueError, match=r"^key_slots: "):  # no prefix, int32, negative
            plan_chunks([Chunk(0, 8, slots)])
    with pytest.raises(ValueError, match=r"^key_slots: "):  # past the cache's 64 slots
        kernel(q, k, v, plan_chunks([Chunk(0, 8, torch.arange(60, 70))]), out, (cache, cache))

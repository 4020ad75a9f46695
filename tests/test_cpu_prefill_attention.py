"""The CPU prefill attention against a float64 reference, with and without a cached prefix, on each
kernel this CPU runs (bfloat16 on AVX-512 BF16 dot products, and on AMX tiles where the CPU has
them; float32 on AVX2 and FMA), and its launcher's checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.cpu_build import AMX, BF16_DOT, KernelBuildError
from kernels.cpu_prefill import AVX2_FMA, Chunk, CpuPrefillAttention, load_prefill_attention, plan_chunks
from tests.cpu_features import cpu_has, has_avx2_fma


@dataclass(frozen=True)
class Kind:
    """A kernel to test: its dtype, engine, and how close to float64 its outputs must be."""

    dtype: torch.dtype
    engine: str
    tolerance: float  # atol and rtol of every element
    mean_error: float  # bound on the mean absolute error

    def tensor(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


# Probabilities and outputs round to bfloat16 once each in the bfloat16 kernel; sums are float32.
BF16 = {"tolerance": 2e-2, "mean_error": 2e-3}
FLOAT32 = Kind(torch.float32, AVX2_FMA, tolerance=1e-5, mean_error=1e-6)
KINDS = [
    pytest.param(
        Kind(torch.bfloat16, BF16_DOT, **BF16),
        id="bfloat16-dot",
        marks=pytest.mark.skipif(not cpu_has("avx512_bf16"), reason="this CPU has no AVX-512 BF16"),
    ),
    pytest.param(
        Kind(torch.bfloat16, AMX, **BF16),
        id="bfloat16-amx",
        marks=pytest.mark.skipif(not cpu_has("amx_bf16"), reason="this CPU has no AMX-BF16"),
    ),
    # Only a CPU without AVX2 and FMA cannot run the float32 kernel: elsewhere a build failure fails here.
    pytest.param(
        FLOAT32,
        id="float32-avx2",
        marks=pytest.mark.skipif(not has_avx2_fma(), reason="this CPU has no AVX2 and FMA"),
    ),
]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param  # type: ignore[no-any-return]


def load_on(kind: Kind, head_dim: int) -> CpuPrefillAttention:
    """The kernel of `kind`, checked to be the one that runs."""
    kernel = load_prefill_attention(head_dim, allow_amx=kind.engine == AMX, dtype=kind.dtype)
    assert kernel.engine == kind.engine and kernel.dtype == kind.dtype
    return kernel


def assert_near(out: torch.Tensor, expected: torch.Tensor, kind: Kind) -> None:
    torch.testing.assert_close(out.double(), expected, atol=kind.tolerance, rtol=kind.tolerance)
    assert (out.double() - expected).abs().mean() < kind.mean_error


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention in float64 of a chunk's queries to its P + len(q) keys: query i sees keys 0..P+i."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * q.shape[2] ** -0.5
    visible = torch.ones(len(q), len(k), dtype=torch.bool).tril(len(k) - len(q))
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


def projections(
    tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int, kind: Kind
) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model has them: views into one [T, (H + 2 Hkv) * Dh] projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = kind.tensor(torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen))
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    return q, k, v


def attends_causally(kind: Kind, head_dim: int, heads: int, kv_heads: int, lengths: list[int]) -> None:
    kernel = load_on(kind, head_dim)
    gap = 3  # rows between prompts that no prompt owns: the kernel must leave them alone
    starts = [sum(lengths[:i]) + gap * (i + 1) for i in range(len(lengths))]
    tokens = starts[-1] + lengths[-1] + gap
    q, k, v = projections(tokens, heads, kv_heads, head_dim, sum(lengths) + heads, kind)
    out = kind.tensor(torch.full((tokens, heads, head_dim), 7.0))
    plan = plan_chunks([Chunk(s, n) for s, n in zip(starts, lengths, strict=True)])
    assert kernel(q, k, v, plan, out) is out
    owned = torch.zeros(tokens, dtype=torch.bool)
    for start, length in zip(starts, lengths, strict=True):
        rows = slice(start, start + length)
        owned[rows] = True
        assert_near(out[rows], reference(q[rows], k[rows], v[rows]), kind)
    assert torch.equal(out[~owned], torch.full_like(out[~owned], 7.0))


# Lengths at the edges of a work item's 16 rows and of the float32 kernel's 96-key softmax blocks.
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize(
    "lengths",
    [[1], [2], [15], [16], [17], [31], [32], [33], [64], [95], [96], [97], [100, 7, 1, 300], [256] * 4],
)
def test_each_prompt_attends_causally_to_itself(
    kind: Kind, head_dim: int, heads: int, kv_heads: int, lengths: list[int]
) -> None:
    attends_causally(kind, head_dim, heads, kv_heads, lengths)


@pytest.mark.skipif(not has_avx2_fma(), reason="this CPU has no AVX2 and FMA")
@pytest.mark.parametrize("lengths", [[1], [17], [200, 33]])
def test_the_float32_kernel_takes_head_dim_128(lengths: list[int]) -> None:
    attends_causally(FLOAT32, 128, 8, 2, lengths)


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize(
    ("prefix", "length"),
    [
        (1, 1),
        (1, 16),
        (15, 2),
        (16, 16),
        (17, 33),
        (95, 1),
        (96, 1),
        (191, 2),
        (250, 6),
        (300, 100),
        (2000, 40),
    ],
)
def test_a_chunk_behind_a_prefix_reads_its_keys_from_the_cache(
    kind: Kind, head_dim: int, heads: int, kv_heads: int, prefix: int, length: int
) -> None:
    kernel = load_on(kind, head_dim)
    block_size, num_blocks = 16, 160
    gen = torch.Generator().manual_seed(prefix * length + heads)
    k_cache = kind.tensor(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen))
    v_cache = kind.tensor(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen))
    # A whole prompt first, then the chunk: its keys at scattered slots, its own written there.
    q, k, v = projections(20 + length, heads, kv_heads, head_dim, prefix, kind)
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
    assert_near(out[rows], reference(q[rows], keys, values), kind)
    assert_near(out[:20], reference(q[:20], k[:20], v[:20]), kind)


def test_a_prompt_gives_the_same_bits_alone_and_among_others(kind: Kind) -> None:
    kernel = load_on(kind, 64)
    q, k, v = projections(90, 9, 3, 64, 1, kind)
    together = kernel(
        q, k, v, plan_chunks([Chunk(0, 40), Chunk(40, 50)]), torch.empty(90, 9, 64, dtype=kind.dtype)
    )
    alone = kernel(
        q[40:], k[40:], v[40:], plan_chunks([Chunk(0, 50)]), torch.empty(50, 9, 64, dtype=kind.dtype)
    )
    assert torch.equal(together[40:], alone)


def test_no_prompts_write_nothing(kind: Kind) -> None:
    kernel = load_on(kind, 64)
    q, k, v = projections(4, 9, 3, 64, 2, kind)
    out = torch.zeros(4, 9, 64, dtype=kind.dtype)
    assert torch.equal(kernel(q, k, v, plan_chunks([]), out), torch.zeros(4, 9, 64, dtype=kind.dtype))


def test_other_head_dims_and_dtypes_are_refused_at_load() -> None:
    with pytest.raises(KernelBuildError, match="head_dim"):
        load_prefill_attention(128)
    with pytest.raises(KernelBuildError, match="head_dim"):
        load_prefill_attention(96, dtype=torch.float32)
    with pytest.raises(KernelBuildError, match="float16"):
        load_prefill_attention(64, dtype=torch.float16)


def test_the_launcher_names_what_it_cannot_take(kind: Kind) -> None:
    kernel = load_on(kind, 64)
    other = torch.float32 if kind.dtype == torch.bfloat16 else torch.bfloat16
    q, k, v = projections(8, 9, 3, 64, 3, kind)
    out = torch.empty(8, 9, 64, dtype=kind.dtype)
    prompts = plan_chunks([Chunk(0, 8)])
    with pytest.raises(ValueError, match=r"^q: "):
        kernel(q.to(other), k, v, prompts, out)
    with pytest.raises(ValueError, match=r"^q: "):
        kernel(q[..., :32], k, v, prompts, out)
    with pytest.raises(ValueError, match=r"^k: "):
        kernel(q, k[:, :2], v, prompts, out)
    with pytest.raises(ValueError, match=r"^k: "):
        kernel(q, k.to(other), v, prompts, out)
    with pytest.raises(ValueError, match=r"^v: "):
        kernel(q, k, v[:4], prompts, out)
    with pytest.raises(ValueError, match=r"^v: "):
        kernel(q, k, v.transpose(0, 1).contiguous().transpose(0, 1), prompts, out)
    with pytest.raises(ValueError, match=r"^out: "):
        kernel(q, k, v, prompts, out[:7])
    with pytest.raises(ValueError, match=r"^out: "):
        kernel(q, k, v, prompts, out.to(other))
    with pytest.raises(ValueError, match=r"^plan: "):
        kernel(q, k, v, plan_chunks([Chunk(4, 5)]), out)
    with pytest.raises(ValueError, match=r"^chunks: "):
        plan_chunks([Chunk(0, 0)])
    with pytest.raises(ValueError, match=r"^chunks: "):
        plan_chunks([Chunk(-1, 3)])
    cache = torch.zeros(4, 16, 3, 64, dtype=kind.dtype)
    behind = plan_chunks([Chunk(0, 8, torch.arange(10))])
    with pytest.raises(ValueError, match=r"^kv_cache: "):
        kernel(q, k, v, behind, out)
    with pytest.raises(ValueError, match=r"^k_cache: "):
        kernel(q, k, v, behind, out, (cache.to(other), cache))
    with pytest.raises(ValueError, match=r"^v_cache: "):
        kernel(q, k, v, behind, out, (cache, cache[:2]))
    for slots in (torch.arange(8), torch.arange(10).int(), torch.arange(-1, 9)):
        with pytest.raises(ValueError, match=r"^key_slots: "):  # no prefix, int32, negative
            plan_chunks([Chunk(0, 8, slots)])
    with pytest.raises(ValueError, match=r"^key_slots: "):  # past the cache's 64 slots
        kernel(q, k, v, plan_chunks([Chunk(0, 8, torch.arange(60, 70))]), out, (cache, cache))

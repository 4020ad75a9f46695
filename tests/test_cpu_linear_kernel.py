"""The small-batch bfloat16 linear kernel against float32 matmul, its checks, and its use in the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.linear import Linear, packed_linear_available
from kernels.cpu_build import AMX, BF16_DOT
from kernels.cpu_linear import MAX_ROWS, SmallBatchLinear, load_small_batch_linear
from scheduler.model_files import find_default_model


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU flag."""
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def has_avx512_bf16() -> bool:
    return cpu_has("avx512_bf16")


def engines_here() -> list[str]:
    """The engines a two-engine CPU kernel runs on here: dot products wherever AVX-512 BF16 is,
    AMX tiles too where the CPU has them."""
    return [BF16_DOT, *([AMX] if cpu_has("amx_bf16") else [])]


# Only a CPU without AVX-512 BF16 cannot run the kernel; anywhere else a build failure fails here.
pytestmark = pytest.mark.skipif(not has_avx512_bf16(), reason="this CPU has no AVX-512 BF16")


@pytest.fixture(scope="module")
def kernel() -> SmallBatchLinear:
    return load_small_batch_linear()


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().T
    return out + bias.float() if bias is not None else out


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float32_matmul(
    kernel: SmallBatchLinear, rows: int, n: int, k: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    out = kernel(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # float32 accumulation of exact bfloat16 products; the one rounding is to bfloat16 at the end.
    torch.testing.assert_close(out.float(), reference(x, weight, bias), rtol=1e-2, atol=1e-2)


def test_rows_of_a_wider_tensor_are_read_at_their_stride(kernel: SmallBatchLinear) -> None:
    weight = (torch.randn(32, 64) / 8).bfloat16()
    wide = torch.randn(2, 96).bfloat16()
    x = wide[:, 16:80]  # rows 96 elements apart
    torch.testing.assert_close(kernel(x, weight).float(), reference(x, weight, None), rtol=1e-2, atol=1e-2)


def test_launcher_rejects_what_the_kernel_cannot_take(kernel: SmallBatchLinear) -> None:
    weight = torch.zeros(16, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x"):
        kernel(torch.zeros(MAX_ROWS + 1, 32, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="x"):
        kernel(torch.zeros(1, 32), weight)  # float32
    with pytest.raises(ValueError, match="weight"):
        kernel(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(16, 48, dtype=torch.bfloat16)[:, :32])
    with pytest.raises(ValueError, match="weight"):
        kernel(torch.zeros(1, 24, dtype=torch.bfloat16), torch.zeros(16, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        kernel(torch.zeros(1, 32, dtype=torch.bfloat16), weight, torch.zeros(8, dtype=torch.bfloat16))
    assert not SmallBatchLinear.supports(torch.zeros(20, 32, dtype=torch.bfloat16))


@pytest.mark.skipif(not packed_linear_available(torch.bfloat16, torch.device("cpu")), reason="no oneDNN")
def test_a_linear_takes_the_kernel_for_small_batches_and_onednn_beyond(kernel: SmallBatchLinear) -> None:
    weight = (torch.randn(960, 576) / 24).bfloat16()
    bias = torch.randn(960).bfloat16()
    linear = Linear(weight, bias, packed=True, small_batch=kernel)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1, 64):
        x = torch.randn(rows, 576).bfloat16()
        torch.testing.assert_close(linear(x).float(), reference(x, weight, bias), rtol=1e-2, atol=2e-2)
    x = torch.randn(1, 576).bfloat16()
    assert torch.equal(linear(x), kernel(x, weight, bias))  # one row: the kernel's result exactly
    # No rows (a step whose chunks all stop short of their prompt's end needs no logits).
    assert linear(torch.empty(0, 576, dtype=torch.bfloat16)).shape == (0, 960)


def test_smollm2_decodes_alike_with_and_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpu_worker.linear
    from gpu_worker.batch import ScheduledChunk, build_forward_batch
    from gpu_worker.kv_cache import allocate_kv_cache
    from gpu_worker.loader import load_model
    from gpu_worker.model import LlamaModel

    # Without the kernel these steps would go to oneDNN with the SiLU fused into the multiply
    # (tests/test_gate_up_linear.py), which rounds the MLP otherwise: compare the linears alone.
    monkeypatch.setattr(gpu_worker.linear, "_post_ops", [False])
    config, weights = load_model(find_default_model())
    logits = []
    for dtype, own in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)):
        model = LlamaModel(config, dtype, "cpu", small_batch_linears=own)
        model.load_weights(weights)
        kv = allocate_kv_cache(config, 4, 16, dtype, torch.device("cpu"))
        prompt = list(range(100, 120))
        steps = [  # a chunk that needs no logits, the rest of the prompt, then a decode
            ScheduledChunk(prompt[:12], 0, [0, 1], False),
            ScheduledChunk(prompt[12:], 12, [0, 1], True),
            ScheduledChunk([7], 20, [0, 1], True),
        ]
        logits.append([model(build_forward_batch([chunk], 16, "cpu"), kv).float() for chunk in steps])
    assert logits[0][0].shape == logits[1][0].shape == (0, config.vocab_size)  # the chunk without logits
    for with_kernel, without, exact in zip(*(steps[1:] for steps in logits), strict=True):
        assert with_kernel.argmax(-1).tolist() == without.argmax(-1).tolist()
        # Every linear rounds its float32 sums to bfloat16 once, whichever kernel runs, but they
        # add in different orders, and over 30 layers each bfloat16 path drifts from float32
        # (up to ~0.5 in a logit here). Running the kernels must not drift further than oneDNN.
        ours, theirs = (with_kernel - exact).abs(), (without - exact).abs()
        assert ours.max() <= 2 * theirs.max() + 0.1
        assert ours.mean() <= 3 * theirs.mean() + 0.02

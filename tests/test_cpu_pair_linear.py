"""The pair-layout linear kernel against float32 matmuls, on each engine this CPU runs (AVX-512 BF16
dot products; AMX tiles too where the CPU has them), its packing, and its launcher's checks."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.linear import Linear
from kernels.cpu_build import AMX
from kernels.cpu_pair_linear import MAX_ROWS, PairLinear, load_pair_linear, pack
from scheduler.model_files import find_default_model
from tests.cpu_features import cpu_has, engines_here

# Only a CPU without AVX-512 BF16 cannot run the kernel; anywhere else a build failure fails here.
needs_bf16_dot = pytest.mark.skipif(not cpu_has("avx512_bf16"), reason="this CPU has no AVX-512 BF16")


@pytest.fixture(params=engines_here())
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def load_on(engine: str) -> PairLinear:
    """The kernel on `engine`, checked to be the one that runs."""
    kernel = load_pair_linear(allow_amx=engine == AMX)
    assert kernel.engine == engine
    return kernel


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


def test_pack_puts_each_pair_of_inputs_beside_its_output() -> None:
    weight = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).bfloat16()  # exact in bfloat16
    packed = pack(weight)
    assert packed.shape == (2, 2, 16, 16, 2)
    # strip s (outputs 16 s..16 s + 15), input step c (inputs 32 c..32 c + 31), pair r, output j
    for s, c, r, j in ((0, 0, 0, 0), (1, 1, 15, 15), (1, 0, 3, 7), (0, 1, 9, 2)):
        out, k = 16 * s + j, 32 * c + 2 * r
        assert packed[s, c, r, j].tolist() == weight[out, k : k + 2].tolist()
    with pytest.raises(ValueError, match="weight"):
        pack(torch.zeros(24, 64, dtype=torch.bfloat16))  # outputs not in 16s


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 15, 16, 17, 33, 48, 63, 64, 65, 130])
@pytest.mark.parametrize("with_bias", [False, True])
# 6, 5 or 11 strips of 16 columns: in pairs with or without one alone (AMX); in runs of 4 and
# fewer per thread (dot products)
@pytest.mark.parametrize("out_features", [96, 80, 176])
def test_kernel_matches_a_float32_matmul(engine: str, rows: int, with_bias: bool, out_features: int) -> None:
    """Every count of row tiles (AMX: 1 or 2 per 32-row pass, the last one partial; dot products:
    blocks of 6 rows and a shorter last one), several passes, and every shape of strip group."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, 160, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 160, generator=gen).bfloat16()
    out = load_on(engine)(x, pack(weight), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    expected = reference(x, weight, bias)
    # float32 sums in another order, then one bfloat16 rounding (half an ulp: 2^-8 relative)
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-2)


@needs_bf16_dot
def test_rows_are_computed_alike_in_any_batch(engine: str) -> None:
    """A row's result does not depend on which other rows share its step (sums are per row)."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    x = torch.randn(40, 64, generator=gen).bfloat16()
    kernel, packed = load_on(engine), pack(weight)
    whole = kernel(x, packed)
    for start, stop in ((0, 1), (5, 22), (17, 40)):
        assert torch.equal(kernel(x[start:stop], packed), whole[start:stop])


@needs_bf16_dot
def test_rows_may_be_strided(engine: str) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 64, generator=gen).bfloat16()
    wide = torch.randn(20, 96, generator=gen).bfloat16()
    x = wide[:, 16:80]  # rows 96 elements apart
    out = load_on(engine)(x, pack(weight))
    assert torch.equal(out, load_on(engine)(x.contiguous(), pack(weight)))


@needs_bf16_dot
def test_launcher_rejects_what_the_kernel_cannot_read(engine: str) -> None:
    kernel = load_on(engine)
    weight = torch.randn(32, 64).bfloat16()
    packed = pack(weight)
    with pytest.raises(ValueError, match="x"):
        kernel(torch.randn(4, 64), packed)  # float32
    with pytest.raises(ValueError, match="x"):
        kernel(torch.randn(64, 4).bfloat16().T, packed)  # columns not contiguous
    with pytest.raises(ValueError, match="packed"):
        kernel(torch.randn(4, 96).bfloat16(), packed)  # input size 96 against 64
    with pytest.raises(ValueError, match="packed"):
        kernel(torch.randn(4, 64).bfloat16(), weight)  # not packed
    with pytest.raises(ValueError, match="bias"):
        kernel(torch.randn(4, 64).bfloat16(), packed, torch.zeros(16, dtype=torch.bfloat16))
    assert kernel(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)
    assert not PairLinear.supports(torch.zeros(32, 48, dtype=torch.bfloat16))  # inputs not in 32s


@needs_bf16_dot
def test_linear_takes_the_pair_kernel_up_to_its_rows_then_onednn(engine: str) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 96, generator=gen).bfloat16()
    bias = torch.randn(64, generator=gen).bfloat16()
    kernel = load_on(engine)
    linear = Linear(weight, bias, packed=True, pair=kernel)
    assert linear.pair_engine == engine
    assert linear.pair_weight is not None
    for rows in (1, MAX_ROWS):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        assert torch.equal(linear(x), kernel(x, linear.pair_weight, bias))
    x = torch.randn(MAX_ROWS + 1, 96, generator=gen).bfloat16()
    expected = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(weight, 64), bias, "none", [], ""
    )
    assert torch.equal(linear(x), expected)
    torch.testing.assert_close(linear(x).float(), reference(x, weight, bias), rtol=8e-3, atol=1e-2)
    # No rows (a step whose chunks all stop short of their prompt's end needs no logits).
    assert linear(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 64)


@needs_bf16_dot
def test_smollm2_decodes_alike_with_and_without_the_pair_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpu_worker.linear
    from gpu_worker.batch import ScheduledChunk, build_forward_batch
    from gpu_worker.kv_cache import allocate_kv_cache
    from gpu_worker.loader import load_model
    from gpu_worker.model import LlamaModel

    # Without the kernel these steps would go to oneDNN with the SiLU fused into the multiply
    # (tests/test_gate_up_linear.py), which rounds the MLP otherwise: compare the linears alone.
    monkeypatch.setattr(gpu_worker.linear, "_post_ops", {torch.float32: False, torch.bfloat16: False})
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

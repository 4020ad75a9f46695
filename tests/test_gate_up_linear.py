"""The MLP's gate/up linear: SiLU(gate) * up through oneDNN post-ops, and the paths around them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpu_worker.linear as linear
from gpu_worker.linear import (
    GateUpLinear,
    onednn_post_ops_available,
    packed_linear_available,
    pair_kernel,
    pair_takes_every_step,
)
from kernels.cpu_build import BF16_DOT
from kernels.cpu_fused import load_cpu_fused_ops
from kernels.cpu_pair_linear import pack
from tests.cpu_features import has_avx512_bf16

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not packed_linear_available(torch.bfloat16, CPU), reason="no oneDNN packed bfloat16 linear here"
)

HIDDEN, FFN = 576, 1536  # SmolLM2's MLP


def weights(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2 * FFN, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16()


def inputs(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = (x.float() @ weight.float().T).chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_op(gate_up: torch.Tensor) -> torch.Tensor:
    """What the model's fused op computes from the bfloat16 projection."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).bfloat16()


def refuse(gate_up: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the fallback ran on a step oneDNN takes")


def test_post_ops_run_here() -> None:
    # This CPU type (CI's) has them; only a CPU without AVX-512 BF16 may lack them.
    if has_avx512_bf16():
        assert onednn_post_ops_available(torch.bfloat16)


@pytest.mark.parametrize("rows", [17, 65, 100, 512])
def test_steps_for_onednn_fuse_silu_and_mul_into_the_multiplies(rows: int) -> None:
    if not onednn_post_ops_available(torch.bfloat16):
        pytest.skip("oneDNN here lacks the post-ops (test_post_ops_run_here says where that fails)")
    weight = weights(rows)
    lin = GateUpLinear(weight, packed=True)  # no pair-layout kernel: oneDNN takes every step
    x = inputs(rows, rows + 1)
    out = lin.silu_and_mul(x, refuse, c_rounding=True)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, FFN)
    # float32 sums of exact bfloat16 products; the SiLU'd gate and the product each round to bfloat16.
    torch.testing.assert_close(out.float(), reference(x, weight), rtol=2e-2, atol=2e-2)
    # As close to float32 as the fused op on the rounded projection, on average.
    ours = (out.float() - reference(x, weight)).abs().mean()
    theirs = (fused_op(lin(x)).float() - reference(x, weight)).abs().mean()
    assert ours <= theirs * 1.1


def test_steps_past_64_rows_take_the_pair_kernel_only_on_its_dot_products() -> None:
    pair = pair_kernel()
    if pair is None:
        pytest.skip("no pair-layout linear on this CPU: oneDNN takes every step (the test above)")
    lin = GateUpLinear(weights(0), packed=True, pair=pair)
    assert lin.takes_own_kernel(inputs(64, 0))
    assert lin.takes_own_kernel(inputs(65, 0)) == pair_takes_every_step(pair) == (pair.engine == BF16_DOT)


@pytest.mark.parametrize("rows", [1, 2, 17, 64, 65, 300])
def test_steps_for_duoserves_own_kernels_take_the_fallback(rows: int) -> None:
    pair = pair_kernel()
    if pair is None:
        pytest.skip("no pair-layout linear on this CPU: oneDNN takes every step (the test above)")
    lin = GateUpLinear(weights(rows), packed=True, pair=pair)
    if not lin.takes_own_kernel(inputs(rows, 0)):
        pytest.skip(f"{rows} rows take oneDNN on the pair kernel's {pair.engine} engine")
    x = inputs(rows, rows)
    seen = []

    def fallback(gate_up: torch.Tensor) -> torch.Tensor:
        seen.append(gate_up)
        return fused_op(gate_up)

    out = lin.silu_and_mul(x, fallback)
    assert len(seen) == 1 and seen[0].shape == (rows, 2 * FFN)
    assert torch.equal(seen[0], pair(x, lin.pair_weight))
    assert torch.equal(out, fused_op(seen[0]))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 65, 300])
def test_the_pair_kernels_dot_products_end_in_the_c_silu_and_mul_to_the_bit(rows: int) -> None:
    """Where `fallback` is the C SiLU-and-multiply (c_rounding), the dot-product engine runs it in
    the product's epilogue: the same bits, the [rows, 2 ffn] projection never written. Rows in
    blocks of six; SmolLM2's 96 gate strips, two a block, and odd counts of strips below."""
    pair = pair_kernel()
    if pair is None or not pair.fuses_silu:
        pytest.skip("the SiLU epilogue is the AVX-512 BF16 dot products' (AMX tiles take the fallback)")
    c_silu = load_cpu_fused_ops(torch.bfloat16).silu_and_mul
    lin = GateUpLinear(weights(rows), packed=True, pair=pair)
    x = inputs(rows, rows)
    assert torch.equal(lin.silu_and_mul(x, refuse, c_rounding=True), c_silu(pair(x, lin.pair_weight)))
    for ffn in (16, 48, 80):  # 1, 3 and 5 strips of gate
        weight = weights(ffn)[: 2 * ffn]
        packed = pack(weight)
        assert torch.equal(pair.silu_and_mul(x, packed), c_silu(pair(x, packed)))
    with pytest.raises(ValueError, match="packed"):
        pair.silu_and_mul(x, pack(weights(1)[:48]))  # three strips: not gate's and up's alike


def test_where_the_pairs_take_every_step_onednn_takes_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the dot products the pair kernel takes every step, strided and empty inputs too, so no
    oneDNN copy of the weight is packed (a bfloat16 copy of every linear less)."""
    pair = pair_kernel()
    if pair is None or not pair_takes_every_step(pair):
        pytest.skip("with AMX tiles (or no pair kernel) oneDNN takes steps past 64 rows")

    def refuse_onednn(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("oneDNN ran where the pairs take every step")

    monkeypatch.setattr(linear, "_onednn_linear", refuse_onednn)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse_onednn)
    weight = weights(5)
    lin = GateUpLinear(weight, packed=True, pair=pair)
    assert lin.pair_every_step and not lin.post_ops
    c_silu = load_cpu_fused_ops(torch.bfloat16).silu_and_mul
    for x in (inputs(300, 5), inputs(7, 5).T.contiguous().T, inputs(0, 5)):  # 300 rows, strided, empty
        assert torch.equal(lin(x), pair(x.contiguous(), lin.pair_weight))
        assert torch.equal(lin.silu_and_mul(x, refuse, c_rounding=True), c_silu(lin(x)))
    assert lin(inputs(0, 5)).shape == (0, 2 * FFN)


@pytest.mark.parametrize("rows", [3, 64, 65, 300])
def test_the_whole_projection_is_still_there(rows: int) -> None:
    # oneDNN packs gate and up apart; calling the linear gives both side by side on every path.
    weight = weights(rows)
    lin = GateUpLinear(weight, packed=True, pair=pair_kernel())
    x = inputs(rows, 7)
    out = lin(x)
    assert out.shape == (rows, 2 * FFN)
    torch.testing.assert_close(out.float(), x.float() @ weight.float().T, rtol=1e-2, atol=1e-2)


def test_without_the_post_ops_onednn_steps_take_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "_post_ops", {torch.float32: False, torch.bfloat16: False})
    lin = GateUpLinear(weights(0), packed=True)
    x = inputs(100, 0)
    assert torch.equal(lin.silu_and_mul(x, fused_op, c_rounding=True), fused_op(lin(x)))


def test_unpacked_weights_take_f_linear_and_the_fallback() -> None:
    weight = weights(1).float()
    lin = GateUpLinear(weight, packed=False)
    x = inputs(100, 1).float()
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    assert torch.equal(lin.silu_and_mul(x, lambda gu: F.silu(gu[:, :FFN]) * gu[:, FFN:]), F.silu(gate) * up)

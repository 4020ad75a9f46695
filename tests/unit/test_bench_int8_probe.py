"""bench/int8_probe.py measures what it says: its reference is Q4_1 times int8 activations, and
its C kernel computes that."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import int8_probe

from kernels.cpu_build import cpu_has


def test_the_reference_is_the_dequantized_product() -> None:
    generator = torch.Generator().manual_seed(1)
    linear = int8_probe.Q4Linear(32, 64, generator)
    x = torch.randn(8, 64, generator=generator)
    xq, xd, xs = int8_probe.quantize(x)
    weights = linear.q.double() * linear.d.double().repeat_interleave(
        32, 1
    ) + linear.m.double().repeat_interleave(32, 1)  # [n, k]: w = d q + m, per 32
    activations = xq.double() * xd.double().repeat_interleave(32, 1)  # [rows, k]: x = dx qx, per 32
    # sx is a float32 sum, so float32 rounding apart
    torch.testing.assert_close(linear.reference(xq, xd, xs), activations @ weights.T, rtol=1e-5, atol=1e-6)
    # and the int8 values round x to within half a step of each block's scale
    assert (activations - x.double()).abs().le(xd.double().repeat_interleave(32, 1) / 2 + 1e-7).all()


@pytest.mark.skipif(
    not (cpu_has("avx512_vnni") and cpu_has("avx512_bf16")), reason="this CPU has no AVX-512 VNNI and BF16"
)
def test_the_probe_checks_its_kernel_and_prints_both_times(capsys: pytest.CaptureFixture[str]) -> None:
    assert int8_probe.main(["--rows", "8", "16", "--repeats", "1", "--peak-iters", "1000"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 8 |", "| 16 |"))]
    assert len(rows) == 2
    for row in rows:
        pair_ms, int8_ms = (float(cell) for cell in row.split("|")[2:4])
        assert pair_ms > 0 and int8_ms > 0


def test_rows_the_tile_does_not_divide_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        int8_probe.main(["--rows", "12"])
    assert "multiples of 8" in capsys.readouterr().err

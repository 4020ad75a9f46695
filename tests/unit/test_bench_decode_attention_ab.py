"""bench/decode_attention_ab.py calls each revision's kernel with the arguments it takes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import decode_attention
import decode_attention_ab

from kernels.cpu_build import SOURCES, build


@pytest.mark.parametrize("vector_bits", [512, 256])
@pytest.mark.parametrize("rev", [None, "4dcfc9c~1"], ids=["this checkout", "before the int8 scales"])
def test_a_revisions_kernel_is_called_with_its_own_arguments(
    rev: str | None, vector_bits: int, tmp_path: Path
) -> None:
    # The kernel took the int8 cache's two scale pointers from 4dcfc9c on; a call that passes the
    # other signature's arguments reads its integers as pointers and crashes.
    sources = SOURCES if rev is None else decode_attention_ab.sources_at(rev, tmp_path)
    defines = decode_attention_ab.smollm2_defines(torch.float32, vector_bits)
    kernel = decode_attention_ab.bind(build("paged_decode_attention.c", defines, sources=sources), sources)
    # The baseline attends to whole blocks: a context of 3 whole blocks.
    case = decode_attention.make_case(3, 48, torch.float32, torch.device("cpu"))
    out = torch.empty_like(case["q"])
    decode_attention_ab.step(kernel, [case], [out])
    want = decode_attention.baseline(case)().reshape(out.shape)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)

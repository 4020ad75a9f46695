"""Test-session setup shared by every test directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# Triton kernels run through Triton's interpreter on the CPU when there is no GPU; the
# variable must be set before any @triton.jit function is defined (kernels are imported lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 requantized by bench/requantize_gguf.py to llama.cpp's Q4_K_M mix: ffn_down's
    1536-long rows in Q4_K and Q6_K super-blocks, the 576-long ones in Q5_0, attn_v in Q8_0 in
    the layers given more bits (so q/k/v differ in type there). Written once per session."""
    path = tmp_path_factory.mktemp("q4_k_m") / "smollm2-q4_k_m.gguf"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "requantize_gguf.py"), str(path), "--type", "Q4_K_M"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "16 Q4_K, 166 Q5_0, 14 Q6_K, 14 Q8_0" in done.stdout
    return path

"""Test-session setup shared by every test directory."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# Triton kernels run through Triton's interpreter on the CPU when there is no GPU; the
# variable must be set before any @triton.jit function is defined (kernels are imported lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The servers' logs go under pytest's temporary directory (it keeps the last three sessions')."""
    from tests.e2e import harness

    harness.LOG_DIR = tmp_path_factory.mktemp("server-logs")
    return harness.LOG_DIR


@pytest.fixture(scope="session")
def requantized_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, str]]:
    """SmolLM2 requantized by bench/requantize_gguf.py to a block type or mix (its `--type`): the
    file, and the script's count of layer matrices by type. Each type is written once per session."""
    written: dict[str, tuple[Path, str]] = {}

    def requantized(type_name: str) -> tuple[Path, str]:
        if type_name not in written:
            path = tmp_path_factory.mktemp(type_name.lower()) / f"smollm2-{type_name.lower()}.gguf"
            done = subprocess.run(
                [sys.executable, str(REPO / "bench" / "requantize_gguf.py"), str(path), "--type", type_name],
                check=True,
                capture_output=True,
                text=True,
            )
            written[type_name] = path, done.stdout
        return written[type_name]

    return requantized


@pytest.fixture(scope="session")
def smollm2_q4_k_m(requantized_smollm2: Callable[[str], tuple[Path, str]]) -> Path:
    """SmolLM2 in llama.cpp's Q4_K_M mix: ffn_down's 1536-long rows in Q4_K and Q6_K
    super-blocks, the 576-long ones in Q5_0, attn_v in Q8_0 in the layers given more bits (so
    q/k/v differ in type there)."""
    path, written = requantized_smollm2("Q4_K_M")
    assert "16 Q4_K, 166 Q5_0, 14 Q6_K, 14 Q8_0" in written
    return path

"""Serving a GGUF file in llama.cpp's Q4_K_M mix (SmolLM2 requantized by bench/requantize_gguf.py):
Q4_K and Q6_K super-blocks, and fused linears whose parts differ in type (attn_v in Q8_0 beside
Q5_0 q and k in some layers), all multiplied on the file's blocks by a real server."""

from __future__ import annotations

from pathlib import Path

from gpu_worker.linear import BLOCK_MAX_ROWS, block_kernel
from tests.e2e.harness import serve_greedy, start_server
from tests.transformers_reference import gguf_model, reference_greedy

NEW_TOKENS = 12


def reference(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers float32 on the same file, greedy."""
    import torch

    model = gguf_model(path)
    with torch.inference_mode():
        return [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]


def test_a_q4_k_m_file_is_served_on_its_blocks_alone(smollm2_q4_k_m: Path) -> None:
    """--dense-weights drop: no float32 copy of any layer linear, so every step (a 300-token
    prefill included) multiplies the file's blocks; greedy output equals transformers float32
    on the same file."""
    server = start_server(
        "--model", str(smollm2_q4_k_m), "--dtype", "float32", "--dense-weights", "drop", "--metrics-port", "0"
    )
    texts = ["Tell me about the sea, " + "and the waves " * 100, "What is the capital of France?"]
    prompts, served = serve_greedy(server, texts, NEW_TOKENS)
    assert len(prompts[0]) > 256
    if block_kernel() is not None:
        log = server.log()
        # 30 layers: qkv in Q5_0 (16) or Q5_0+Q8_0 (14), o/gate_up in Q5_0, down in Q4_K (16) or
        # Q6_K (14); the tied head on the embedding's Q8_0.
        assert (
            f"121 of 121 linears take the block kernel for steps of up to {BLOCK_MAX_ROWS} rows "
            "(16 Q4_K, 76 Q5_0, 14 Q5_0+Q8_0, 14 Q6_K, 1 Q8_0)" in log
        )
        assert "120 of them hold no dense copy and take it at every step (--dense-weights drop)" in log
    assert served == reference(smollm2_q4_k_m, prompts)

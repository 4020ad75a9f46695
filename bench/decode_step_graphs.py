"""One decode step of a SmolLM2-135M-shaped model on CUDA: eager launches against a CUDA graph replay.

    python bench/decode_step_graphs.py

Random weights of SmolLM2-135M's shape (30 layers, 576 wide, 9/3 heads, 49152 vocabulary),
bfloat16, the triton backend, contexts of 301 tokens. For batches of 1, 8, 64 and 256 decodes it
times the model's forward launched op by op (host clock) and the same forward captured once and
replayed (CUDA events), and checks that both give the same logits. This is what `--cuda-graphs` saves per decode step.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from decode_attention import graph_ms

from gpu_worker.batch import ScheduledChunk, build_forward_batch
from gpu_worker.kv_cache import allocate_kv_cache
from gpu_worker.loader import load_model
from gpu_worker.model import LlamaModel
from gpu_worker.startup import make_attention


def main() -> int:
    import transformers

    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,  # type: ignore[call-arg]  # transformers 5 takes it into rope_parameters
        max_position_embeddings=8192,
    )
    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    model_config, weights = load_model(Path(folder))
    device = torch.device("cuda")
    model = LlamaModel(model_config, torch.bfloat16, device)
    model.load_weights(weights)
    model.use_attention(make_attention("triton", model_config, torch.bfloat16, device, 16))
    kv_cache = allocate_kv_cache(model_config, 8192, 16, torch.bfloat16, device)
    print("| batch | eager ms | graph ms | speedup | max |diff| |")
    for size in (1, 8, 64, 256):
        chunks = [ScheduledChunk([5 + i], 300, list(range(i * 20, i * 20 + 20)), True) for i in range(size)]
        batch = build_forward_batch(chunks, 16, device)

        def step(batch=batch) -> torch.Tensor:
            return model(batch, kv_cache)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            eager_logits = step()
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - started) / 20 * 1e3
        graph_time, graph_logits = graph_ms(step, repeats=20)
        diff = (graph_logits.float() - eager_logits.float()).abs().max().item()
        print(f"| {size} | {eager_ms:.3f} | {graph_time:.3f} | {eager_ms / graph_time:.1f}x | {diff:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared by the worker tests: a tiny random Llama saved as a Hugging Face directory, and Steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_worker.loader import ModelConfig, load_model
from protos import worker_pb2

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.15,  # wide logits: no near-ties for float rounding to flip
}


def save_tiny_llama(path: Path, **overrides: Any) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random Llama of TINY_LLAMA's shape (with `overrides`) saved at `path`, loaded back."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})).save_pretrained(
        path
    )
    return load_model(path)


def prompt_step(
    step_id: int,
    seqs: list[tuple[int, int, list[int]]],
    lane: int = 0,
    urgent: bool = False,
    vocab_size: int = 256,
) -> worker_pb2.Step:
    """A step starting sequences (seq_id, prompt_len, block ids) from scratch, whole prompts."""
    step = worker_pb2.Step(step_id=step_id, lane=lane, urgent=urgent)
    for seq_id, length, blocks in seqs:
        prompt = (np.arange(length, dtype="<i4") * 7 + seq_id) % (vocab_size - 6) + 3
        step.new_sequences.append(
            worker_pb2.NewSequence(
                seq_id=seq_id,
                token_ids=prompt.tobytes(),
                prompt_len=length,
                block_ids=np.asarray(blocks, dtype="<i4").tobytes(),
                num_new_tokens=length,
            )
        )
    return step

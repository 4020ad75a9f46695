"""Greedy decoding by transformers, the reference the parity tests hold duoserve's output to."""

from __future__ import annotations

from typing import Any

import torch


def reference_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`max_new_tokens` greedy tokens after `prompt`, end-of-sequence tokens taken like any other
    (as the server's ignore_eos does): `generate` with its KV cache and no EOS id."""
    ids = torch.tensor([prompt], device=hf_model.device)
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()

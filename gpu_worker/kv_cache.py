"""Paged KV-cache tensors: per layer one K and one V cache, allocated once at worker start.

A layer's K (or V) cache is a dense tensor of the model's dtype, or with `--kv-cache-dtype int8`
an Int8Cache: int8 rows and a float32 scale per row (kernels/kv_int8.py).
"""

from __future__ import annotations

import torch

from gpu_worker.model_config import ModelConfig
from kernels.kv_int8 import Int8Cache

CacheTensor = torch.Tensor | Int8Cache
LayerCache = tuple[CacheTensor, CacheTensor]
KVCache = list[LayerCache]


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, kv_int8: bool = False
) -> int:
    """Bytes one block of `block_size` token slots takes across all layers, K and V (an int8
    cache's rows one byte an element, plus a float32 scale per row)."""
    assert block_size > 0, f"block_size must be positive, got {block_size}"
    rows = 2 * config.num_layers * block_size * config.num_kv_heads
    if kv_int8:
        return rows * (config.head_dim + 4)
    return rows * config.head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_int8: bool = False,
) -> KVCache:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim], zero-filled (with
    `kv_int8`, Int8Caches of that shape).

    Slot `s` of the flattened view is block `s // block_size`, offset `s % block_size`.

    Written in full here, so that no request pays for the pool's first touch: with the pool a
    lazily faulted mapping instead, a server ready 0.6-1.1 s sooner served its first 64×256×128
    runs at 0.83-0.90× the throughput (a 2-core EPYC VM, where first touches of memory are dear).
    """
    assert num_blocks > 0 and block_size > 0, f"need positive sizes, got {num_blocks=} {block_size=}"
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if kv_int8:
        return [
            (Int8Cache.zeros(*shape, device), Int8Cache.zeros(*shape, device))
            for _ in range(config.num_layers)
        ]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]

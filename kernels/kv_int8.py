"""The int8 KV cache (`--kv-cache-dtype int8`): its layout, and the torch definitions the C kernels are tested against.

Each cached row (one token's keys or values for one kv head) is stored as int8 with a float32
scale of its own: scale = max|x| / 127, q = round(x * 127 / max|x|), x ≈ q * scale. Half the bytes
of a bfloat16 cache, so a decode step, which reads every sequence's whole context, reads half as
much, and the same memory holds twice the tokens. The scales sit apart from the rows, per block
and kv head, so that a block's scales for one head are contiguous:

    values: [num_blocks, block_size, num_kv_heads, head_dim] int8
    scales: [num_blocks, num_kv_heads, block_size] float32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._launch import require, require_tensor

QMAX = 127.0


@dataclass(frozen=True, slots=True)
class Int8Cache:
    """One layer's keys (or values) in the int8 cache."""

    values: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    scales: torch.Tensor  # [num_blocks, num_kv_heads, block_size] float32

    @staticmethod
    def zeros(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device | str
    ) -> Int8Cache:
        return Int8Cache(
            torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.int8, device=device),
            torch.zeros((num_blocks, num_kv_heads, block_size), dtype=torch.float32, device=device),
        )

    def to(self, device: torch.device | str) -> Int8Cache:
        return Int8Cache(self.values.to(device), self.scales.to(device))

    @property
    def shape(self) -> torch.Size:
        """The rows' shape, [num_blocks, block_size, num_kv_heads, head_dim], as a dense cache's."""
        return self.values.shape

    def check(self) -> None:
        """ValueError naming the part that does not fit the layout above."""
        values, scales = self.values, self.scales
        if values.dtype != torch.int8 or values.dim() != 4 or not values.is_contiguous():
            raise ValueError(
                f"int8 cache values: need contiguous int8 [blocks, block_size, Hkv, D], got "
                f"{values.dtype} {tuple(values.shape)}"
            )
        blocks, block_size, heads, _ = values.shape
        if (
            scales.dtype != torch.float32
            or scales.shape != (blocks, heads, block_size)
            or not scales.is_contiguous()
        ):
            raise ValueError(
                f"int8 cache scales: need contiguous float32 {(blocks, heads, block_size)}, got "
                f"{scales.dtype} {tuple(scales.shape)}"
            )


def cache_rows(cache: torch.Tensor | Int8Cache) -> torch.Tensor:
    """A layer's K or V rows: a dense cache itself, an int8 cache's values."""
    return cache.values if isinstance(cache, Int8Cache) else cache


def int8_pair(
    k_cache: torch.Tensor | Int8Cache, v_cache: torch.Tensor | Int8Cache
) -> tuple[Int8Cache, Int8Cache]:
    """Both caches as int8, each checked and of one shape; ValueError naming k_cache where they
    differ in kind, or either is dense."""
    if not (isinstance(k_cache, Int8Cache) and isinstance(v_cache, Int8Cache)):
        raise ValueError("k_cache: the K and V caches must both be int8 (Int8Cache) or both dense")
    k_cache.check()
    v_cache.check()
    require(v_cache.shape == k_cache.shape, "v_cache", v_cache.values, f"shape {tuple(k_cache.shape)}")
    require(v_cache.values.device == k_cache.values.device, "v_cache", v_cache.values, "on k_cache's device")
    return k_cache, v_cache


def check_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | Int8Cache,
    v_cache: torch.Tensor | Int8Cache,
    slot_mapping: torch.Tensor,
    cpu: bool,
) -> tuple[Int8Cache, Int8Cache]:
    """What a write into the int8 cache needs of its arguments (k, v [T, Hkv, D]; slots < 0 are
    skipped, the others below the pool's), on the CPU for the C write (`cpu`), else on a Triton
    device; the caller checks the rows' dtype and layout."""
    k_cache, v_cache = int8_pair(k_cache, v_cache)
    require(v.shape == k.shape, "v", v, f"shape {tuple(k.shape)}")
    require(
        k.dim() == 3 and k_cache.shape[2:] == k.shape[1:],
        "k_cache",
        k_cache.values,
        "[.., .., Hkv, D] like k",
    )
    require(k_cache.values.device == k.device, "k_cache", k_cache.values, f"on {k.device} like k")
    require_tensor(slot_mapping, "slot_mapping", dims=1, dtypes=(torch.int64,), cpu=cpu)
    require(slot_mapping.device == k.device, "slot_mapping", slot_mapping, f"on {k.device} like k")
    require(slot_mapping.shape[0] == k.shape[0], "slot_mapping", slot_mapping, f"{k.shape[0]} entries")
    # The C write trusts its slots, so they are checked here. On a GPU the check would read a
    # device value back at every layer (a sync, and no CUDA graph could capture the step), and
    # the dense Triton write does not make it either: the scheduler's slots are its bound there.
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if cpu and k.shape[0] and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot_mapping: slots must be < {num_slots}, got {int(slot_mapping.max())}")
    return k_cache, v_cache


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as (int8 [..., D], float32 scales [...]), row by row; the C write's arithmetic."""
    x = x.float()
    top = x.abs().amax(dim=-1)
    # A tensor by a tensor: a true division, as the C write's (`QMAX / top` would be QMAX * (1 / top)).
    inverse = torch.where(top > 0, torch.full_like(top, QMAX) / top, torch.zeros_like(top))
    q = torch.round(x * inverse[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, top * (1.0 / QMAX)


def quantize_cache(cache: torch.Tensor) -> Int8Cache:
    """A dense cache [num_blocks, block_size, Hkv, D], quantized row by row into the int8 layout."""
    values, scales = quantize_rows(cache)  # [blocks, bs, Hkv, D], [blocks, bs, Hkv]
    return Int8Cache(values.contiguous(), scales.transpose(1, 2).contiguous())


def write_kv_int8(
    k_cache: Int8Cache, v_cache: Int8Cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values ([T, Hkv, D]) at their slots, quantized; slots < 0 are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.values.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for cache, rows in ((k_cache, k[keep]), (v_cache, v[keep])):
        q, scales = quantize_rows(rows)  # [T', Hkv, D], [T', Hkv]
        cache.values[blocks, offsets] = q
        cache.scales[blocks, :, offsets] = scales


def dequantize_slots(cache: Int8Cache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows at `slots` ([S] int64) as [S, Hkv, D] of `dtype`."""
    block_size = cache.values.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    return (cache.values[blocks, offsets].float() * cache.scales[blocks, :, offsets][..., None]).to(dtype)


def dequantize_blocks(cache: Int8Cache, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The blocks at `blocks` ([B] int64), their rows times their scales, into `out` ([B, block_size, Hkv, D])."""
    scales = cache.scales.index_select(0, blocks).transpose(1, 2)[..., None]  # [B, bs, Hkv, 1]
    return torch.mul(cache.values.index_select(0, blocks), scales, out=out)


def dequantize(cache: Int8Cache, dtype: torch.dtype) -> torch.Tensor:
    """The whole cache as a dense [num_blocks, block_size, Hkv, D] tensor of `dtype` (for tests and references)."""
    return (cache.values.float() * cache.scales.transpose(1, 2)[..., None]).to(dtype)

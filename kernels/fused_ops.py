"""Small fused Triton kernels of the decoder layer, each beside the torch code it must match.

- `write_kv`: store a step's K/V into the paged caches at their slots (slot < 0: skipped); into
  an int8 cache (kernels/kv_int8.py) quantized, bit for bit as its torch definition.
- `fused_add_rms_norm`: residual += x, then RMSNorm(residual) * weight, in one pass.
- `silu_and_mul`: SiLU(gate) * up from the fused [T, 2F] gate/up projection.
- `rotary_embedding`: rotate q and k in place (half-split pairs, HF layout), angles from
  positions and inverse frequencies (Llama 3 scaling is in the frequencies).

Rounding follows the torch path step by step (float32 math, cast to the tensor dtype where
torch's ops would round), so outputs match the references within one unit of the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import next_power_of_2, require, require_tensor, require_token_rows
from kernels.kv_int8 import Int8Cache, check_write

# ------------------------------------------------------------------------------------ KV write


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hkv, D], rows `k_stride` apart
    v_ptr,
    k_cache_ptr,  # [num_slots, Hkv * D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64
    k_stride,
    v_stride,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    cols = tl.arange(0, ROW_PAD)
    ok = cols < ROW
    k = tl.load(k_ptr + token * k_stride + cols, mask=ok)
    v = tl.load(v_ptr + token * v_stride + cols, mask=ok)
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=ok)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=ok)


@triton.jit
def _quantize_row(src_ptr, dst_ptr, scale_ptr, dims, ok, scale_at):
    """One row as int8 and its scale: max|x| / 127, each value rounded to nearest, ties to even (torch.round)."""
    x = tl.load(src_ptr + dims, mask=ok, other=0.0).to(tl.float32)
    top = tl.max(tl.abs(x), axis=0)
    # A true division, as torch's; an all-zero row (top 0) gets 0, and no division by zero.
    inverse = tl.where(top > 0.0, tl.math.div_rn(127.0, tl.where(top > 0.0, top, 1.0)), 0.0)
    scaled = x * inverse
    low = tl.floor(scaled)
    rest = scaled - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    rounded = tl.where((rest > 0.5) | ((rest == 0.5) & odd), low + 1.0, low)
    rounded = tl.minimum(tl.maximum(rounded, -127.0), 127.0)
    tl.store(dst_ptr + dims, rounded.to(tl.int8), mask=ok)
    tl.store(scale_ptr + scale_at, top * (1.0 / 127.0))


@triton.jit
def _write_kv_int8_kernel(
    k_ptr,  # [T, Hkv, D], rows `k_stride` apart
    v_ptr,
    k_cache_ptr,  # [num_slots, Hkv, D] int8
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, Hkv, block_size] float32
    v_scale_ptr,
    slot_mapping_ptr,  # [T] int64
    k_stride,
    v_stride,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    dims = tl.arange(0, HEAD_DIM_PAD)
    ok = dims < HEAD_DIM
    row = (slot * NUM_KV_HEADS + head) * HEAD_DIM
    scale_at = ((slot // BLOCK_SIZE) * NUM_KV_HEADS + head) * BLOCK_SIZE + slot % BLOCK_SIZE
    _quantize_row(
        k_ptr + token * k_stride + head * HEAD_DIM, k_cache_ptr + row, k_scale_ptr, dims, ok, scale_at
    )
    _quantize_row(
        v_ptr + token * v_stride + head * HEAD_DIM, v_cache_ptr + row, v_scale_ptr, dims, ok, scale_at
    )


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]; each token's Hkv * D values contiguous (a view into qkv is fine)
    v: torch.Tensor,
    k_cache: torch.Tensor | Int8Cache,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | Int8Cache,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    if isinstance(k_cache, Int8Cache) or isinstance(v_cache, Int8Cache):
        _write_kv_int8(k, v, k_cache, v_cache, slot_mapping)
        return
    for name, tensor in (("k", k), ("v", v)):
        require_token_rows(tensor, name)
    require_tensor(k_cache, "k_cache", dims=4)
    require_tensor(v_cache, "v_cache", dims=4)
    require_tensor(slot_mapping, "slot_mapping", dims=1, dtypes=(torch.int64,))
    num_tokens, num_kv_heads, head_dim = k.shape
    require(v.shape == k.shape, "v", v, f"shape {tuple(k.shape)}")
    require(
        k_cache.shape[2:] == (num_kv_heads, head_dim),
        "k_cache",
        k_cache,
        f"[.., .., {num_kv_heads}, {head_dim}]",
    )
    require(v_cache.shape == k_cache.shape, "v_cache", v_cache, f"shape {tuple(k_cache.shape)}")
    require(k.dtype == k_cache.dtype == v.dtype == v_cache.dtype, "k_cache", k_cache, f"dtype {k.dtype}")
    require(slot_mapping.shape[0] == num_tokens, "slot_mapping", slot_mapping, f"{num_tokens} entries")
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, ROW_PAD=next_power_of_2(row)
    )


def _write_kv_int8(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | Int8Cache,
    v_cache: torch.Tensor | Int8Cache,
    slot_mapping: torch.Tensor,
) -> None:
    for name, tensor in (("k", k), ("v", v)):
        require_token_rows(tensor, name)
    k_cache, v_cache = check_write(k, v, k_cache, v_cache, slot_mapping, cpu=False)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_int8_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache.values,
        v_cache.values,
        k_cache.scales,
        v_cache.scales,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]


# ------------------------------------------------------------------------------------ residual + RMSNorm


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, C]
    residual_ptr,  # [T, C], updated in place to x + residual
    weight_ptr,  # [C]
    out_ptr,  # [T, C]
    eps,
    COLS: tl.constexpr,
    COLS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, COLS_PAD)
    ok = cols < COLS
    x = tl.load(x_ptr + row * COLS + cols, mask=ok, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * COLS + cols, mask=ok, other=0.0).to(tl.float32)
    summed = (x + residual).to(residual_ptr.dtype.element_ty)
    tl.store(residual_ptr + row * COLS + cols, summed, mask=ok)
    h = summed.to(tl.float32)
    normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / COLS + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = normed.to(out_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out_ptr + row * COLS + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:  # [T, C]
    """residual += x (in place); returns RMSNorm(residual) * weight."""
    require_tensor(x, "x", dims=2)
    require_tensor(residual, "residual", dims=2)
    require_tensor(weight, "weight", dims=1)
    require(
        residual.shape == x.shape and residual.dtype == x.dtype,
        "residual",
        residual,
        f"like x {tuple(x.shape)}",
    )
    require(
        weight.shape[0] == x.shape[1] and weight.dtype == x.dtype, "weight", weight, f"[{x.shape[1]}] like x"
    )
    out = torch.empty_like(x)
    if x.shape[0]:
        cols = x.shape[1]
        _add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, eps, COLS=cols, COLS_PAD=next_power_of_2(cols)
        )
    return out


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """What the torch model does: hidden = hidden + x; RMSNorm in float32, cast, times weight."""
    residual.copy_(residual + x)
    h = residual.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# ------------------------------------------------------------------------------------ SiLU and mul


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, FFN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < FFN
    gate = tl.load(gate_up_ptr + row * 2 * FFN + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * FFN + FFN + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * FFN + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:  # [T, 2F] → [T, F]
    require_tensor(gate_up, "gate_up", dims=2)
    require(gate_up.shape[1] % 2 == 0, "gate_up", gate_up, "an even number of columns (gate then up)")
    tokens, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, ffn)
    if tokens:
        block = min(block, next_power_of_2(ffn))
        _silu_and_mul_kernel[(tokens, -(-ffn // block))](gate_up, out, FFN=ffn, BLOCK=block)
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ------------------------------------------------------------------------------------ rotary


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, heads, D], rows `row_stride` apart, rotated in place
    positions_ptr,  # [T] int64
    inv_freq_ptr,  # [D / 2] float32
    row_stride,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, HALF_PAD)
    ok = cols < HALF
    position = tl.load(positions_ptr + token).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + cols, mask=ok, other=0.0)
    dtype = x_ptr.dtype.element_ty
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(dtype).to(tl.float32)
    base = x_ptr + token * row_stride + head * 2 * HALF
    x1 = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + cols, mask=ok, other=0.0).to(tl.float32)
    # As torch computes x1 * cos - x2 * sin in the tensor dtype: each product rounded, then the sum.
    first = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    second = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(base + cols, first.to(dtype), mask=ok)
    tl.store(base + HALF + cols, second.to(dtype), mask=ok)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place; each token's heads and dims must be contiguous."""
    for name, tensor in (("q", q), ("k", k)):
        require_token_rows(tensor, name)
    require_tensor(positions, "positions", dims=1, dtypes=(torch.int64,))
    require_tensor(inv_freq, "inv_freq", dims=1, dtypes=(torch.float32,))
    head_dim = q.shape[2]
    require(k.shape[2] == head_dim and head_dim % 2 == 0, "k", k, f"head_dim {head_dim} (even) like q")
    require(inv_freq.shape[0] == head_dim // 2, "inv_freq", inv_freq, f"{head_dim // 2} frequencies")
    require(positions.shape[0] == q.shape[0] == k.shape[0], "positions", positions, f"{q.shape[0]} entries")
    if q.shape[0] == 0:
        return
    half = head_dim // 2
    for tensor in (q, k):
        _rotary_kernel[(tensor.shape[0], tensor.shape[1])](
            tensor,
            positions,
            inv_freq,
            tensor.stride(0),
            HEADS=tensor.shape[1],
            HALF=half,
            HALF_PAD=next_power_of_2(half),
        )


def rotary_embedding_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> None:
    """The torch model's rope: cos/sin in float32, cast to the dtype, rotate_half, written back in place."""
    from gpu_worker.model import apply_rope, rope_cos_sin

    cos, sin = rope_cos_sin(inv_freq, positions, q.dtype)
    q.copy_(apply_rope(q, cos, sin))
    k.copy_(apply_rope(k, cos, sin))

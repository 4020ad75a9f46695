"""The "torch" attention backend: paged KV write plus attention built on scaled_dot_product_attention.

Invariant relied on everywhere: a step first writes its own K/V into the cache (by
`slot_mapping`), then attends, so cached prefixes and this step's tokens are read alike.
Decodes never materialise repeated K/V: the G query heads that share a KV head are laid along
SDPA's query-length axis. Prefill chunks repeat their (small) K/V per query head instead, which
keeps CPU SDPA on its flash kernel.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from gpu_worker.batch import DecodeAttention, ForwardBatch, PrefillAttention
from gpu_worker.kv_cache import CacheTensor
from kernels.cpu_decode import CpuDecodeAttention, check_block_tables
from kernels.cpu_fused import CpuFusedOps
from kernels.cpu_prefill import Chunk, CpuPrefillAttention, PrefillPlan, plan_chunks
from kernels.cpu_stack import CpuDecodeStack
from kernels.kv_int8 import Int8Cache, dequantize_blocks, dequantize_slots, int8_pair, write_kv_int8


class FusedOps(Protocol):
    """The decoder layer's fused small ops (Triton on CUDA: kernels/fused_ops.py; C on the CPU:
    kernels/cpu_fused.py). A backend that has them runs the model's fused forward."""

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> None: ...

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: CacheTensor,
        v_cache: CacheTensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys/values ([T, Hkv, D]) into the paged caches ([blocks, block_size, Hkv, D])."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_put_((slot_mapping,), k)
    v_cache.view(-1, num_kv_heads, head_dim).index_put_((slot_mapping,), v)


def fresh_runs(chunks: Sequence[PrefillAttention]) -> list[list[PrefillAttention]]:
    """The chunks in order, consecutive whole prompts (no cached prefix) of one length and with
    adjacent rows grouped into runs; every other chunk is a run of its own."""
    runs: list[list[PrefillAttention]] = []
    for chunk in chunks:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and chunk.key_slots is None
            and last.key_slots is None
            and chunk.num_tokens == last.num_tokens
            and chunk.token_start == last.token_start + last.num_tokens
        ):
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


class TorchPagedAttention:
    """CPU/reference paged attention. Keeps a decode gather workspace per calling thread."""

    name = "torch"
    fused_ops: FusedOps | None = None  # the torch path runs the model's unfused forward

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        assert num_heads % num_kv_heads == 0, f"{num_heads=} is not a multiple of {num_kv_heads=}"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        # Reused across layers and steps: allocating tens of MB per layer costs more than the
        # attention itself on CPU (fresh pages fault in on every step). Per thread, so forwards
        # running on two threads (two lanes) never share a buffer.
        self._local = threading.local()

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: tuple[CacheTensor, CacheTensor],
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H * D]
        """Write K/V for the step's tokens, then attend each token to its sequence's context."""
        k_cache, v_cache = kv_cache
        self._write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        out = q.new_empty(q.shape)  # [T, H, D]
        if batch.decode is not None:
            num = batch.decode.num_seqs
            out[:num] = self._decode(q[:num], k_cache, v_cache, batch.decode)
        if batch.prefills and isinstance(k_cache, Int8Cache) and isinstance(v_cache, Int8Cache):
            k, v = self._as_cached(k_cache, v_cache, k, v, batch.slot_mapping)
        self._prefills(q, k, v, k_cache, v_cache, batch.prefills, out)
        return out.view(q.shape[0], -1)

    def _as_cached(
        self, k_cache: Int8Cache, v_cache: Int8Cache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's own rows as the int8 cache now holds them (times their scales, in k's dtype),
        so that a prompt's chunks attend to the same values whether they come fresh, behind a
        cached prefix or again after a preemption: its greedy tokens then do not depend on what
        the cache held. Rows without a slot keep their values."""
        written = slots >= 0
        every = bool(written.all())
        out = []
        for cache, rows in ((k_cache, k), (v_cache, v)):
            cached = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)  # contiguous
            if every:
                self._dequantize_into(cache, slots, cached)
            else:
                cached.copy_(rows)
                cached[written] = dequantize_slots(cache, slots[written], rows.dtype)
            out.append(cached)
        return out[0], out[1]

    def _dequantize_into(self, cache: Int8Cache, slots: torch.Tensor, out: torch.Tensor) -> None:
        """out [S, Hkv, D] = the int8 cache's rows at `slots` times their scales: in C where the
        CPU fused ops are loaded, else in torch."""
        if isinstance(self.fused_ops, CpuFusedOps):
            self.fused_ops.dequantize_kv_int8(cache, slots, out)
        else:
            out.copy_(dequantize_slots(cache, slots, out.dtype))

    def _prefills(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: CacheTensor,
        v_cache: CacheTensor,
        chunks: Sequence[PrefillAttention],
        out: torch.Tensor,  # [T, H, D]: each chunk's rows are written
    ) -> None:
        for run in fresh_runs(chunks):
            if len(run) > 1:  # whole prompts of one length, rows back to back: one call for all
                rows = slice(run[0].token_start, run[-1].token_start + run[-1].num_tokens)
                out[rows] = self._fresh_prefills(q[rows], k[rows], v[rows], len(run))
                continue
            chunk = run[0]
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)

    def _write_kv(
        self,
        k_cache: CacheTensor,
        v_cache: CacheTensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        if self.fused_ops is not None:  # C or Triton: either kind of cache
            self.fused_ops.write_kv(k, v, k_cache, v_cache, slots)
        elif isinstance(k_cache, Int8Cache) or isinstance(v_cache, Int8Cache):
            write_kv_int8(*int8_pair(k_cache, v_cache), k, v, slots)
        else:
            write_kv(k_cache, v_cache, k, v, slots)

    def _decode(
        self, q: torch.Tensor, k_cache: CacheTensor, v_cache: CacheTensor, meta: DecodeAttention
    ) -> torch.Tensor:  # [D, H, Dh]
        num, length = meta.num_seqs, meta.max_context
        k_buf, v_buf = self._gather_buffers(num * length, q)
        # Whole blocks at a time: one contiguous copy per block instead of one per token (an int8
        # cache's rows times their scales).
        blocks_shape = (meta.key_blocks.shape[0], *k_cache.shape[1:])  # [D * L / bs, bs, Hkv, Dh]
        for cache, buf in ((k_cache, k_buf), (v_cache, v_buf)):
            if isinstance(cache, Int8Cache):
                dequantize_blocks(cache, meta.key_blocks, buf.view(blocks_shape))
            else:
                torch.index_select(cache, 0, meta.key_blocks, out=buf.view(blocks_shape))
        keys = k_buf.view(num, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [D, Hkv, L, Dh]
        values = v_buf.view(num, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # q head h uses kv head h // G, so [D, H, Dh] → [D, Hkv, G, Dh] puts each group on the query axis.
        queries = q.reshape(num, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.key_mask
        )  # [D, Hkv, G, Dh]
        return out.reshape(num, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,  # [Tq, H, Dh]
        k: torch.Tensor,  # [Tq, Hkv, Dh]
        v: torch.Tensor,  # [Tq, Hkv, Dh]
        k_cache: CacheTensor,
        v_cache: CacheTensor,
        meta: PrefillAttention,
    ) -> torch.Tensor:  # [Tq, H, Dh]
        if meta.key_slots is None:  # no cached prefix: this step's K/V are the whole context
            keys, values, mask = k, v, None
        else:
            keys, values = (
                dequantize_slots(cache, meta.key_slots, q.dtype)
                if isinstance(cache, Int8Cache)
                else cache.view(-1, self.num_kv_heads, self.head_dim).index_select(0, meta.key_slots)
                for cache in (k_cache, v_cache)
            )  # [C, Hkv, Dh] each
            mask = meta.mask
        # 4-D inputs: CPU SDPA takes its flash kernel only for [B, H, S, Dh]. With enable_gqa it
        # reads each kv head for its group of query heads: measured here (torch 2.13, 256-token
        # chunks of SmolLM2) the same bits as repeating the heads, 18% faster causal and 2.4x
        # faster behind a cached prefix.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )  # [1, H, Tq, Dh]
        return out[0].transpose(0, 1)

    def _fresh_prefills(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int
    ) -> torch.Tensor:  # [count * S, H, Dh]
        """`count` whole prompts of S tokens each, rows back to back: causal attention within each,
        as one [count, H, S, Dh] call (the same bits as one call each; 20% faster for 8 prompts of
        256 tokens here, measured)."""
        s = q.shape[0] // count
        out = F.scaled_dot_product_attention(
            q.view(count, s, self.num_heads, self.head_dim).transpose(1, 2),
            k.view(count, s, self.num_kv_heads, self.head_dim).transpose(1, 2),
            v.view(count, s, self.num_kv_heads, self.head_dim).transpose(1, 2),
            is_causal=True,
            enable_gqa=True,
        )  # [count, H, S, Dh]
        return out.transpose(1, 2).reshape(q.shape)

    def _gather_buffers(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ws: tuple[torch.Tensor, torch.Tensor] | None = getattr(self._local, "workspace", None)
        if ws is None or ws[0].shape[0] < rows or ws[0].dtype != like.dtype or ws[0].device != like.device:
            # Grow geometrically: decode contexts lengthen by one token per step.
            grown = rows if ws is None else max(rows, ws[0].shape[0] * 3 // 2)
            shape = (grown, self.num_kv_heads, self.head_dim)
            ws = (like.new_empty(shape), like.new_empty(shape))
            self._local.workspace = ws
        return ws[0][:rows], ws[1][:rows]


class CpuPagedAttention(TorchPagedAttention):
    """The CPU backend: decodes read the paged cache in place through the C kernel (kernels/cpu_decode.py).
    A step's prefill chunks take the AMX kernel where it runs (kernels/cpu_prefill.py), all in one
    call, else the torch path. With `fused_ops` (kernels/cpu_fused.py) the KV write is one C call
    too (see TorchPagedAttention._write_kv), and the model runs its fused forward.

    With an int8 KV cache (`--kv-cache-dtype int8`, kernels/kv_int8.py) the write quantizes, decodes
    read the int8 rows in place, and a chunk behind a cached prefix attends to its rows dequantized
    into a dense buffer first (the prefill kernels read a dense cache)."""

    name = "cpu"
    fused_ops: CpuFusedOps | None

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kernel: CpuDecodeAttention,
        fused_ops: CpuFusedOps | None = None,
        decode_stack: CpuDecodeStack | None = None,
        prefill_kernel: CpuPrefillAttention | None = None,
        small_decode_stack: CpuDecodeStack | None = None,
    ) -> None:
        """`decode_stack` (with `fused_ops`; bfloat16 on pair-layout weights, or float32 or bfloat16
        on GGUF blocks): decode steps of up to its max_rows sequences run every layer in one C call
        (kernels/cpu_stack.py). `small_decode_stack` (bfloat16 on GGUF blocks, where the CPU
        multiplies bfloat16): the one that steps of up to SMALL_STEP_ROWS sequences take."""
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.kernel = kernel
        self.fused_ops = fused_ops
        self.decode_stack = decode_stack if fused_ops is not None else None
        self.small_decode_stack = small_decode_stack if fused_ops is not None else None
        self.prefill_kernel = prefill_kernel

    def _prefills(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: CacheTensor,
        v_cache: CacheTensor,
        chunks: Sequence[PrefillAttention],
        out: torch.Tensor,
    ) -> None:
        if isinstance(k_cache, Int8Cache) and isinstance(v_cache, Int8Cache):
            k_cache, v_cache, chunks = self._dense_prefixes(k_cache, v_cache, chunks, q)
        assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor), (
            "K and V caches differ in kind"
        )
        if self.prefill_kernel is None or q.dtype != self.prefill_kernel.dtype:
            super()._prefills(q, k, v, k_cache, v_cache, chunks, out)
            return
        # Checked and laid out once per step, not once per layer.
        planned: tuple[Sequence[PrefillAttention], PrefillPlan] | None = getattr(self._local, "plan", None)
        if planned is None or planned[0] is not chunks:
            plan = plan_chunks([Chunk(c.token_start, c.num_tokens, c.key_slots) for c in chunks])
            self._local.plan = planned = (chunks, plan)
        # The step's K/V are in the cache by now, so a chunk behind a prefix reads all its keys there.
        self.prefill_kernel(q, k, v, planned[1], out, (k_cache, v_cache))

    def _dense_prefixes(
        self, k_cache: Int8Cache, v_cache: Int8Cache, chunks: Sequence[PrefillAttention], q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Sequence[PrefillAttention]]:
        """The rows that the chunks behind a cached prefix read, dequantized into dense [S, 1, Hkv, D]
        caches of q's dtype, and the chunks with their key slots renumbered into them (the same for
        every layer of the step, so kept per step)."""
        kept = getattr(self._local, "dense_chunks", None)
        if kept is None or kept[0] is not chunks:
            slots, renumbered, at = [], [], 0
            for chunk in chunks:
                if chunk.key_slots is None:
                    renumbered.append(chunk)
                    continue
                count = chunk.key_slots.shape[0]
                slots.append(chunk.key_slots)
                renumbered.append(
                    dataclasses.replace(
                        chunk, key_slots=torch.arange(at, at + count, device=chunk.key_slots.device)
                    )
                )
                at += count
            gathered = torch.cat(slots) if slots else None
            self._local.dense_chunks = kept = (chunks, gathered, renumbered)
        _, gathered, renumbered = kept
        if gathered is None:  # no chunk reads the cache
            empty = q.new_empty((1, 1, self.num_kv_heads, self.head_dim))
            return empty, empty, renumbered
        rows = gathered.shape[0]
        shape = (rows, 1, self.num_kv_heads, self.head_dim)
        # Into this thread's buffers (kept between layers and steps): no per-layer temporaries.
        k_rows, v_rows = self._gather_buffers(rows, q)
        self._dequantize_into(k_cache, gathered, k_rows)
        self._dequantize_into(v_cache, gathered, v_rows)
        return k_rows.view(shape), v_rows.view(shape), renumbered

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: CacheTensor,
        v_cache: CacheTensor,
        meta: DecodeAttention,
    ) -> torch.Tensor:  # [D, H, Dh]
        self.check_once(meta, k_cache)
        return self.kernel(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.context_lens)

    def check_once(self, meta: DecodeAttention, k_cache: CacheTensor) -> None:
        """The kernels trust block ids and lengths: check them once per batch, not once per layer."""
        if getattr(self._local, "checked", None) is not meta:
            check_block_tables(meta.block_tables, meta.context_lens, k_cache.shape[0], k_cache.shape[1])
            self._local.checked = meta


class TritonPagedAttention:
    """The GPU backend: KV write, decode (split-K) and chunked prefill, each one Triton launch per layer.

    Also runs on the CPU under TRITON_INTERPRET=1, which is how the tests exercise it there.
    """

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from kernels import fused_ops, paged_attention  # triton is needed only here

        assert num_heads % num_kv_heads == 0, f"{num_heads=} is not a multiple of {num_kv_heads=}"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.fused_ops: FusedOps | None = fused_ops  # the module's functions
        self._write_kv = fused_ops.write_kv
        self._decode = paged_attention.paged_decode_attention
        self._prefill = paged_attention.paged_prefill_attention

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D], rows may be strided (a view into qkv)
        kv_cache: tuple[CacheTensor, CacheTensor],
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H * D]
        k_cache, v_cache = kv_cache  # dense, or int8 (the kernels read both)
        self._write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        decodes = batch.decode.num_seqs if batch.decode is not None else 0
        if batch.decode is not None:
            meta = batch.decode
            out[:decodes] = self._decode(
                q[:decodes], k_cache, v_cache, meta.block_tables, meta.context_lens, meta.max_context
            )
        if batch.prefills:
            out[decodes:] = self._prefill(
                q[decodes:],
                k_cache,
                v_cache,
                batch.block_tables[decodes:],
                batch.query_start_loc[decodes:] - decodes,
                batch.context_lens[decodes:],
                max(chunk.num_tokens for chunk in batch.prefills),
            )
        return out.view(q.shape[0], -1)

"""One forward step's inputs: scheduled chunks → flat token tensors plus attention metadata.

Token order inside a ForwardBatch: first every single-token chunk (decodes, attended together in
one call), then each multi-token chunk (prefill, one attention call each). Logits rows still come
back in the order of the caller's chunks (those with `needs_logits`), via `logits_indices`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from gpu_worker.streams import to_device

Upload = Callable[[np.ndarray, torch.dtype], torch.Tensor]
"""Moves one host array to the step's device as `dtype` (default: a plain copy; the CUDA SBO
pipeline passes gpu_worker.streams.DeviceUpload, which copies from pinned memory on its data stream)."""


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's part of a step."""

    token_ids: Sequence[int]  # the tokens computed in this step (their K/V is written to the cache)
    start_position: int  # position of token_ids[0] = number of tokens already in the cache
    block_table: Sequence[int]  # all the sequence's KV block ids, covering start_position + len(token_ids)
    needs_logits: bool  # True when the chunk ends at the sequence's newest token (sample after it)


@dataclass(slots=True)
class LateInputs:
    """Input ids of a step staged before the step in front of it finished: decodes whose input is
    the token that step samples (a lookahead step, see scheduler/planner.py). Staging leaves their
    rows for `write`, which fills them in from the sequences' token lists just before the forward,
    once the step in front has appended its tokens."""

    rows: list[int]  # batch token rows
    token_lists: list[list[int]]  # each row's sequence's tokens, appended to as they are sampled
    positions: list[int]  # each row's input: token_lists[i][positions[i]]

    def ready(self) -> bool:
        """Whether the steps in front have appended every token these rows read."""
        return all(
            position < len(tokens) for tokens, position in zip(self.token_lists, self.positions, strict=True)
        )

    def write(self, input_ids: torch.Tensor) -> None:
        """Fill the rows of `input_ids` ([T] int64) in, wherever it is: on a GPU one copy queued on
        the current stream, which must be the step's compute stream, behind its inputs' upload."""
        values = []
        for row, tokens, position in zip(self.rows, self.token_lists, self.positions, strict=True):
            assert position < len(tokens), f"batch row {row}: its input token {position} is not sampled yet"
            values.append(tokens[position])
        device = input_ids.device
        input_ids.index_copy_(0, to_device(self.rows, device), to_device(values, device))


@dataclass(slots=True)
class DecodeAttention:
    """The single-query sequences (batch rows [0, num_seqs)), attended in one call.

    The CPU kernel reads the cache in place through `block_tables` and `context_lens`. The torch
    path gathers keys whole blocks at a time (a block is one contiguous run of the cache), so
    its context is padded up to whole blocks and `key_mask` hides the padding.
    """

    num_seqs: int  # D
    max_context: int  # L: blocks per row * block_size, covering the longest context
    block_tables: torch.Tensor  # [D, L / block_size] int32, padded with block 0
    context_lens: torch.Tensor  # [D] int32
    key_blocks: torch.Tensor  # [D * L / block_size] int64: row i's block table, padded with block 0
    key_mask: torch.Tensor  # [D, 1, 1, L] bool: True where j < context length of row i


@dataclass(slots=True)
class PrefillAttention:
    """One multi-token chunk: causal within itself, full attention to its cached prefix."""

    token_start: int  # first batch row of the chunk
    num_tokens: int  # Tq
    start_position: int  # P: tokens of the sequence already cached before this step
    key_slots: torch.Tensor | None  # [P + Tq] int64 slots of positions 0..P+Tq-1; None when P == 0
    mask: torch.Tensor | None  # [Tq, P + Tq] bool: key j visible to query i iff j <= P + i; None when P == 0


@dataclass(slots=True)
class ForwardBatch:
    """Device tensors for one step; N sequences, T tokens, S of them needing logits."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) each token's K/V goes to
    logits_indices: torch.Tensor  # [S] int64 batch rows, in the order of the chunks with needs_logits
    query_start_loc: torch.Tensor  # [N + 1] int32: sequence n owns rows [q[n], q[n + 1])
    context_lens: torch.Tensor  # [N] int32: start_position + chunk length
    block_tables: torch.Tensor  # [N, max_blocks] int32, padded with block 0
    chunk_order: tuple[int, ...]  # batch sequence n is caller chunk chunk_order[n]
    block_size: int
    decode: DecodeAttention | None
    prefills: tuple[PrefillAttention, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])


def build_forward_batch(
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    device: torch.device | str,
    upload: Upload | None = None,
) -> ForwardBatch:
    """Flatten `chunks` (any order, prefill and decode mixed) into one step's tensors on `device`."""
    if upload is None:
        upload = functools.partial(_to_device, device=device)
    assert chunks, "a forward batch needs at least one chunk"
    assert block_size > 0, f"block_size must be positive, got {block_size}"
    num_seqs = len(chunks)
    lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((c.start_position for c in chunks), dtype=np.int64, count=num_seqs)
    assert (lens > 0).all(), f"empty chunk at index {int(np.argmin(lens))}"
    assert (starts >= 0).all(), f"negative start_position at index {int(np.argmin(starts))}"
    is_decode = lens == 1
    # Stable: decodes first, then prefills, each group in the caller's order.
    order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
    num_decodes = int(is_decode.sum())

    lens_o, starts_o = lens[order], starts[order]
    ctx_o = starts_o + lens_o  # [N]
    query_start = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(lens_o, out=query_start[1:])
    num_tokens = int(query_start[-1])

    table_lens = np.fromiter((len(chunks[i].block_table) for i in order), dtype=np.int64, count=num_seqs)
    short = np.flatnonzero(table_lens * block_size < ctx_o)
    assert short.size == 0, (
        f"chunk {int(order[short[0]])}: block_table covers {int(table_lens[short[0]]) * block_size} slots "
        f"but the chunk reaches position {int(ctx_o[short[0]])}"
    )
    tables = np.zeros((num_seqs, max(int(table_lens.max()), 1)), dtype=np.int64)  # [N, max_blocks]
    for row, i in enumerate(order):
        tables[row, : table_lens[row]] = chunks[i].block_table

    token_ids = np.concatenate([np.asarray(chunks[i].token_ids, dtype=np.int64) for i in order])  # [T]
    seq_of_token = np.repeat(np.arange(num_seqs), lens_o)  # [T]
    positions = starts_o[seq_of_token] + (np.arange(num_tokens) - query_start[:-1][seq_of_token])  # [T]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size  # [T]

    rank = np.empty(num_seqs, dtype=np.int64)
    rank[order] = np.arange(num_seqs)  # rank[chunk] = its batch sequence index
    wants = np.fromiter((c.needs_logits for c in chunks), dtype=bool, count=num_seqs)
    logits_rows = query_start[1:][rank[wants]] - 1  # [S] last token of each chunk needing logits

    def put(array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return upload(array, dtype)

    decode = None
    if num_decodes:
        decode = decode_attention(tables[:num_decodes], ctx_o[:num_decodes], block_size, upload)
    prefills = tuple(
        _prefill_attention(
            int(query_start[n]), int(lens_o[n]), int(starts_o[n]), tables[n], block_size, upload
        )
        for n in range(num_decodes, num_seqs)
    )
    return ForwardBatch(
        input_ids=put(token_ids),
        positions=put(positions),
        slot_mapping=put(slots),
        logits_indices=put(logits_rows),
        query_start_loc=put(query_start, torch.int32),
        context_lens=put(ctx_o, torch.int32),
        block_tables=put(tables, torch.int32),
        chunk_order=tuple(int(i) for i in order),
        block_size=block_size,
        decode=decode,
        prefills=prefills,
    )


def select_decode_rows(batch: ForwardBatch, rows: np.ndarray, table_width: int) -> ForwardBatch:
    """Rows `rows` of a decode-only CPU `batch`, in that order, laid out as build_forward_batch lays
    out those sequences: block tables `table_width` wide (their longest table), attention metadata
    as wide as their longest context. Indexes numpy views: cheaper than torch ops per tensor."""
    assert batch.decode is not None and not batch.prefills, "select_decode_rows takes a decode-only batch"
    assert len(rows) > 0 and table_width >= 1, f"{len(rows)} rows, table width {table_width}"
    count = len(rows)
    context_lens = batch.context_lens.numpy()[rows]  # [n] int32
    tables = np.ascontiguousarray(batch.block_tables.numpy()[rows, :table_width])  # [n, W] int32
    return ForwardBatch(
        input_ids=torch.from_numpy(batch.input_ids.numpy()[rows]),
        positions=torch.from_numpy(batch.positions.numpy()[rows]),
        slot_mapping=torch.from_numpy(batch.slot_mapping.numpy()[rows]),
        logits_indices=torch.arange(count),
        query_start_loc=torch.arange(count + 1, dtype=torch.int32),
        context_lens=torch.from_numpy(context_lens),
        block_tables=torch.from_numpy(tables),
        chunk_order=tuple(range(count)),
        block_size=batch.block_size,
        decode=decode_attention(tables, context_lens.copy(), batch.block_size),
        prefills=(),
    )


def upload_batch(
    batch: ForwardBatch, device: torch.device | str, upload: Upload | None = None
) -> ForwardBatch:
    """`batch`, built on the host, with every tensor moved to `device` through `upload` (as
    build_forward_batch would have moved it): a forecast staged on the host, taken on a GPU."""
    move: Upload = upload if upload is not None else functools.partial(_to_device, device=device)

    def moved(record: _Record) -> _Record:
        """`record` with each of its tensor fields on the device (None stays None)."""
        changes: dict[str, Any] = {}
        for field in dataclasses.fields(record):
            value = getattr(record, field.name)
            if isinstance(value, torch.Tensor):
                changes[field.name] = move(value.numpy(), value.dtype)
        return dataclasses.replace(record, **changes)

    return dataclasses.replace(
        moved(batch),
        decode=None if batch.decode is None else moved(batch.decode),
        prefills=tuple(moved(prefill) for prefill in batch.prefills),
    )


_Record = TypeVar("_Record", ForwardBatch, DecodeAttention, PrefillAttention)


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)


def _slots_of_positions(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of `positions` ([..., L]) through block table rows `table` ([..., max_blocks])."""
    blocks = np.take_along_axis(table, positions // block_size, axis=-1)
    return blocks * block_size + positions % block_size


def decode_attention(
    tables: np.ndarray, context_lens: np.ndarray, block_size: int, upload: Upload | None = None
) -> DecodeAttention:
    """Decode rows' attention metadata from their block tables ([D, >= blocks they use]) and
    context lengths, through `upload` (default: CPU tensors, sharing the arrays where the dtype
    already matches)."""
    if upload is None:
        upload = functools.partial(_to_device, device="cpu")
    num = len(context_lens)
    num_blocks = -(-int(context_lens.max()) // block_size)
    max_context = num_blocks * block_size
    key_mask = np.arange(max_context)[None, :] < context_lens[:, None]  # [D, L]
    return DecodeAttention(
        num_seqs=num,
        max_context=max_context,
        block_tables=upload(tables[:, :num_blocks], torch.int32),
        context_lens=upload(context_lens, torch.int32),
        key_blocks=upload(tables[:, :num_blocks].reshape(-1), torch.int64),
        key_mask=upload(key_mask.reshape(num, 1, 1, max_context), torch.bool),
    )


def _prefill_attention(
    token_start: int,
    num_tokens: int,
    start: int,
    table: np.ndarray,
    block_size: int,
    upload: Upload,
) -> PrefillAttention:
    if start == 0:
        return PrefillAttention(token_start, num_tokens, 0, key_slots=None, mask=None)
    context = start + num_tokens
    key_pos = np.arange(context)  # [C]
    mask = key_pos[None, :] <= (start + np.arange(num_tokens))[:, None]  # [Tq, C]
    return PrefillAttention(
        token_start,
        num_tokens,
        start,
        key_slots=upload(_slots_of_positions(table, key_pos, block_size), torch.int64),
        mask=upload(mask, torch.bool),
    )

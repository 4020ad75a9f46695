"""The next decode step, staged while the current one computes (CPU SBO).

A sequence is in at most one in-flight batch, and with the CPU's one decode lane the scheduler
sends step k+1 only after step k's result: the message that SBO would stage during step k does
not exist yet. But what it will say is nearly always known: each sequence that samples a token in
step k decodes it in step k+1, one position further on. So right after staging step k, the
staging thread builds that successor's batch (positions, slots, block tables, context lengths,
attention metadata) and the running-sequence arrays the scheduler will send for it. Step k's
`finish` writes the sampled tokens straight into the batch's input ids.

When step k+1 arrives:
- with exactly those arrays (the common case: the same sequences in the same order), staging is
  only writing in the blocks the scheduler added for sequences whose new token starts one;
- with some of those sequences, in any order (others finished or were released; the scheduler
  orders a step differently from the one that admitted its prompts), the batch's rows are
  selected;
- with anything else (a new or re-sent sequence, a prefill chunk, an urgent step, a block
  allocated ahead of need), the forecast is dropped and the step staged in full.

What is left for after arrival is kept to a few byte comparisons and array writes: just after a
forward pass has streamed the weights and the KV cache through the CPU's caches, every Python and
torch operation runs several times slower than in a microbenchmark.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_worker.batch import ForwardBatch, ScheduledChunk, build_forward_batch, select_decode_rows
from protos import worker_pb2
from protos.running import RunningEntry, pack_running, unpack_running

if TYPE_CHECKING:
    from gpu_worker.runner import SeqState

Taken = tuple[ForwardBatch, list["SeqState"], float]
"""A step staged from a forecast: its batch, its sampled sequences, and the seconds spent staging it."""


@dataclass(slots=True)
class DecodeForecast:
    """Decode step k+1 of D sequences (its rows), built from step k."""

    states: list[SeqState]  # step k's sampled sequences, in its logits order
    row_of: dict[int, int]  # sequence id -> row
    expected: worker_pb2.RunningSequences  # Step.running as the scheduler packs it, less the new block ids
    num_computed: np.ndarray  # [D] int64: each sequence's computed tokens when step k+1 comes
    table_lens: np.ndarray  # [D] int64: block table lengths with the blocks the scheduler adds
    new_block_column: np.ndarray  # [D] int64: where the block the scheduler adds goes; -1: none
    block_rows: list[int]  # the rows with a new block, and its column
    block_columns: list[int]
    views: tuple[np.ndarray, ...]  # the batch's slot mapping, block tables, decode tables, key blocks
    batch: ForwardBatch  # its input ids are step k's sampled tokens; new blocks still to fill in
    seconds: float  # spent building it
    used: bool = False  # taken (or tried): never again

    def take(self, step: worker_pb2.Step, seqs: dict[int, SeqState]) -> Taken | None:
        """Step `step` from this forecast, with its sequences advanced as a full staging would
        (released ones dropped from `seqs`); None, with nothing changed, when it cannot be."""
        if step.new_sequences or step.urgent:
            return None
        started = time.perf_counter()
        if self._matches_exactly(step):
            self._fill_blocks(step.running.new_block_ids)
            taken: tuple[ForwardBatch, list[SeqState]] | None = (self.batch, self.states)
        else:
            taken = self._select(step, seqs)
        if taken is None:
            return None
        batch, states = taken
        for state in states:
            state.num_computed += 1
        return batch, states, self.seconds + time.perf_counter() - started

    def _matches_exactly(self, step: worker_pb2.Step) -> bool:
        running, expected = step.running, self.expected
        return (
            not step.released_seq_ids
            and running.seq_ids == expected.seq_ids
            and running.num_computed_tokens == expected.num_computed_tokens
            and running.num_new_tokens == expected.num_new_tokens
            and running.num_new_blocks == expected.num_new_blocks
            and len(running.new_block_ids) == 4 * len(self.block_rows)
        )

    def _fill_blocks(self, block_ids: bytes) -> None:
        """The exact case: write the scheduler's new blocks where the forecast left block 0."""
        if not self.block_rows:
            return
        batch = self.batch
        assert batch.decode is not None
        blocks = np.frombuffer(block_ids, dtype="<i4").tolist()
        slots, tables, decode_tables, key_blocks = self.views
        per_row = decode_tables.shape[1]
        for row, column, block in zip(self.block_rows, self.block_columns, blocks, strict=True):
            slots[row] = block * batch.block_size  # the new token is the block's first
            tables[row, column] = decode_tables[row, column] = block
            key_blocks[row * per_row + column] = block
            self.states[row].block_table.append(block)

    def _select(
        self, step: worker_pb2.Step, seqs: dict[int, SeqState]
    ) -> tuple[ForwardBatch, list[SeqState]] | None:
        """The forecast's rows that `step` runs, in its order, if it runs nothing else."""
        try:
            running = unpack_running(step.running)
        except ValueError:
            return None  # staged in full, which says what is wrong
        found = [self.row_of.get(seq_id) for seq_id in running.seq_ids.tolist()]
        if not found or None in found or len(set(found)) != len(found):
            return None
        rows = np.asarray(found, dtype=np.int64)
        new_block = self.new_block_column[rows] >= 0
        released = np.frombuffer(step.released_seq_ids, dtype="<u8").tolist()
        if (
            not np.array_equal(running.num_computed_tokens, self.num_computed[rows])
            or not (running.num_new_tokens == 1).all()
            or not np.array_equal(running.num_new_blocks, new_block.astype(np.int64))
            or any(self.row_of.get(seq_id) in found for seq_id in released)
        ):
            return None
        for seq_id in released:
            seqs.pop(seq_id, None)
        batch = select_decode_rows(self.batch, rows, int(self.table_lens[rows].max()))
        sub_rows = np.flatnonzero(new_block)
        blocks = _add_blocks(
            batch, sub_rows, self.new_block_column[rows[sub_rows]], step.running.new_block_ids
        )
        for row, block in zip(rows[sub_rows].tolist(), blocks, strict=True):
            self.states[row].block_table.append(block)
        return batch, [self.states[row] for row in rows.tolist()]


def _add_blocks(batch: ForwardBatch, rows: np.ndarray, columns: np.ndarray, block_ids: bytes) -> list[int]:
    """Batch rows `rows` start block `block_ids[i]` (one each, int32) at table column `columns[i]`
    with their new token; returns the blocks. CPU tensors: the numpy views write into them."""
    if not len(rows):
        return []
    assert batch.decode is not None
    slots = batch.slot_mapping.numpy()
    tables = batch.block_tables.numpy()
    decode_tables = batch.decode.block_tables.numpy()
    key_blocks = batch.decode.key_blocks.numpy()
    per_row = decode_tables.shape[1]
    blocks = np.frombuffer(block_ids, dtype="<i4").tolist()
    for row, column, block in zip(rows.tolist(), columns.tolist(), blocks, strict=True):
        slots[row] = block * batch.block_size  # the new token is the block's first
        tables[row, column] = decode_tables[row, column] = block
        key_blocks[row * per_row + column] = block
    return blocks


def forecast_decode(
    batch: ForwardBatch | None, states: list[SeqState], sampled_tokens: np.ndarray, block_size: int
) -> DecodeForecast | None:
    """The successor of the CPU step staged as `batch`, whose sampled sequences `states` get
    their tokens in `sampled_tokens`; None unless every sequence in that step samples (a prompt
    chunk that does not end its prompt is followed by the next chunk, not a decode)."""
    started = time.perf_counter()
    if (
        batch is None
        or not states
        or batch.num_logits != len(states)
        or len(batch.chunk_order) != len(states)
    ):
        return None
    chunks = []
    entries = []
    table_lens = np.empty(len(states), dtype=np.int64)
    new_block_column = np.full(len(states), -1, dtype=np.int64)
    for row, state in enumerate(states):
        position = state.num_computed  # the token step k samples goes here
        table: list[int] = state.block_table
        covered = len(table) * block_size
        if position > covered:
            return None
        new_blocks: tuple[int, ...] = ()
        if position == covered:
            new_block_column[row] = len(table)
            table = [*table, 0]  # block 0 stands in for the one the scheduler will add
            new_blocks = (0,)
        table_lens[row] = len(table)
        chunks.append(ScheduledChunk((0,), position, table, True))
        entries.append(RunningEntry(state.seq_id, position, 1, new_blocks))
    expected = pack_running(entries)
    expected.ClearField("new_block_ids")
    forecast_batch = build_forward_batch(chunks, block_size, "cpu")
    forecast_batch.input_ids = torch.from_numpy(sampled_tokens)  # [D] int64, written by finish
    assert forecast_batch.decode is not None
    block_rows = np.flatnonzero(new_block_column >= 0)
    # CPU tensors: writing into these views writes into the batch.
    views = (
        forecast_batch.slot_mapping.numpy(),
        forecast_batch.block_tables.numpy(),
        forecast_batch.decode.block_tables.numpy(),
        forecast_batch.decode.key_blocks.numpy(),
    )
    return DecodeForecast(
        states=list(states),
        row_of={state.seq_id: row for row, state in enumerate(states)},
        expected=expected,
        num_computed=np.fromiter((s.num_computed for s in states), dtype=np.int64, count=len(states)),
        table_lens=table_lens,
        new_block_column=new_block_column,
        block_rows=block_rows.tolist(),
        block_columns=new_block_column[block_rows].tolist(),
        views=views,
        batch=forecast_batch,
        seconds=time.perf_counter() - started,
    )


class Forecasts:
    """The staging thread's forecasts, each filed under every sequence it holds (not by lane: the
    scheduler may send a sequence's next step on either lane).

    Invariants: a forecast's sequences are as they were when it was built, and no two forecasts
    share a sequence. A step staged in full drops the forecasts sharing a sequence with it
    (`drop_touching`); one taken from a forecast uses it up. Used forecasts leave the index when
    the next one is added, which happens while a step computes, not while one is staged.
    """

    def __init__(self) -> None:
        self._by_seq: dict[int, DecodeForecast] = {}

    def add(self, forecast: DecodeForecast) -> None:
        for seq_id in [s for s, f in self._by_seq.items() if f.used]:
            del self._by_seq[seq_id]
        self.drop_touching(forecast.row_of)
        for seq_id in forecast.row_of:
            self._by_seq[seq_id] = forecast

    def take(self, step: worker_pb2.Step, seqs: dict[int, SeqState]) -> Taken | None:
        """`step` staged from the forecast holding its first sequence, which is used up; None
        (nothing changed) when there is none or the step is not one it can serve."""
        if len(step.running.seq_ids) < 8:
            return None
        forecast = self._by_seq.get(int.from_bytes(step.running.seq_ids[:8], "little"))
        if forecast is None or forecast.used:
            return None
        forecast.used = True
        taken = forecast.take(step, seqs)
        if taken is not None and step.released_seq_ids:
            self.drop_touching(np.frombuffer(step.released_seq_ids, dtype="<u8").tolist())
        return taken

    def drop_touching(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            forecast = self._by_seq.get(seq_id)
            if forecast is not None:
                self._remove(forecast)

    def _remove(self, forecast: DecodeForecast) -> None:
        for seq_id in forecast.row_of:
            if self._by_seq.get(seq_id) is forecast:
                del self._by_seq[seq_id]

    def clear(self) -> None:
        self._by_seq.clear()

    def filed_under(self) -> set[int]:
        """The sequences forecasts that can still be taken hold."""
        return {seq_id for seq_id, forecast in self._by_seq.items() if not forecast.used}

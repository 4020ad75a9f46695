"""The next step, staged while the current one computes (SBO; on a GPU, a long prompt's next window).

What step k+1 will say is nearly always known while step k computes: each sequence that samples
a token in step k decodes it in step k+1, one position further on, and a prompt whose chunk did
not reach its end goes on with its next window, as long as the last. So right after staging step
k, the staging thread builds that successor's batch (tokens, positions, slots, block tables,
context lengths, attention metadata) and the running-sequence arrays the scheduler will send for
it, decodes first, then prompt windows, each in step k's order. In a decode-only forecast the
input ids are step k's token buffer, which its `finish` fills; otherwise the decode rows' inputs
are late inputs, written in before the forward (batch.LateInputs).

The message itself comes while step k still computes when the scheduler looks ahead
(scheduler/planner.py), or only after step k's result, without lookahead; either way taking the
forecast keeps what is left to do after arrival short.

When step k+1 arrives:
- with exactly those arrays (the common case: the same sequences in the same order), staging is
  only writing in the blocks the scheduler added where a new token or window starts one;
- with some of those sequences, in any order, all decoding (others finished or were released;
  the scheduler orders a step differently from the one that admitted its prompts), the batch's
  rows are selected;
- with anything else (a new or re-sent sequence, a window of another length or in another place,
  an urgent step, a block allocated ahead of need), the forecast is dropped and the step staged
  in full. Nothing is lost but the time spent building it.

What is left for after arrival is kept to a few byte comparisons and array writes: just after a
forward pass has streamed the weights and the KV cache through the CPU's caches, every Python and
torch operation runs several times slower than in a microbenchmark.

On a GPU a step staged on arrival is staged while the other lane's step runs, so only a step that
leaves a prompt unfinished is forecast (ModelRunner.forecast): a lone long prompt's next window
is then built on the host while the device computes the current one, and a step taken from it is
only copied to the device (batch.upload_batch), on the data stream with CUDA SBO.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_worker.batch import (
    ForwardBatch,
    LateInputs,
    ScheduledChunk,
    build_forward_batch,
    decode_attention,
    select_decode_rows,
)
from protos import worker_pb2
from protos.running import RunningEntry, pack_running, unpack_running

if TYPE_CHECKING:
    from gpu_worker.runner import SeqState


@dataclass(slots=True)
class Taken:
    """A step staged from a forecast."""

    batch: ForwardBatch
    sampled: list[SeqState]  # in logits-row order
    scheduled: list[tuple[SeqState, int]]  # every sequence and its new tokens (see forecast_next_step)
    seconds: float  # spent staging it, the forecast's building included
    late: LateInputs | None  # the decode rows' inputs, when they are not step k's token buffer itself


@dataclass(slots=True)
class _Window:
    """A prompt's next window in the forecast step (its chunk in step k did not end the prompt)."""

    state: SeqState
    start: int  # first position: the sequence's computed tokens when step k+1 comes
    length: int
    row: int  # batch sequence index (after the D decode rows)
    token_start: int  # first batch row of its tokens
    new_columns: list[int]  # block-table columns of the blocks the scheduler adds for it
    key_slots: np.ndarray  # its PrefillAttention.key_slots (positions 0..start+length-1), a view
    ends_prompt: bool


@dataclass(slots=True)
class StepForecast:
    """Step k+1, built from step k: D decode rows, then prompt windows."""

    states: list[SeqState]  # the decode rows: step k's sampled sequences, in its logits order
    windows: list[_Window]
    row_of: dict[int, int]  # sequence id -> row
    expected: worker_pb2.RunningSequences  # Step.running as the scheduler packs it, less the new block ids
    num_computed: np.ndarray  # [D] int64: each sequence's computed tokens when step k+1 comes
    table_lens: np.ndarray  # [D] int64: block table lengths with the blocks the scheduler adds
    new_block_column: np.ndarray  # [D] int64: where the block the scheduler adds goes; -1: none
    block_rows: list[int]  # the rows with a new block, and its column
    block_columns: list[int]
    views: tuple[np.ndarray, ...]  # _views(batch)
    batch: ForwardBatch  # the decode rows' input ids and the new blocks still to fill in
    seconds: float  # spent building it
    used: bool = False  # taken (or tried): never again

    @property
    def seq_ids(self) -> list[int]:
        return [*self.row_of, *(window.state.seq_id for window in self.windows)]

    def take(self, step: worker_pb2.Step, seqs: dict[int, SeqState]) -> Taken | None:
        """Step `step` from this forecast, with its sequences advanced as a full staging would
        (released ones dropped from `seqs`); None, with nothing changed, when it cannot be."""
        if step.new_sequences or step.urgent:
            return None
        started = time.perf_counter()
        windows = self.windows
        late = None
        if self._matches_exactly(step):
            batch, states = self.batch, self.states
            if windows:  # else the input ids are step k's token buffer itself
                late = _decode_inputs(states)
            blocks = np.frombuffer(step.running.new_block_ids, dtype="<i4").tolist()
            decode_blocks = blocks[: len(self.block_rows)]
            _write_decode_blocks(
                self.views, batch.block_size, self.block_rows, self.block_columns, decode_blocks
            )
            for row, block in zip(self.block_rows, decode_blocks, strict=True):
                states[row].block_table.append(block)
            self._fill_windows(blocks[len(self.block_rows) :])
        elif not windows:
            selected = self._select(step, seqs)
            if selected is None:
                return None
            batch, states = selected
            late = _decode_inputs(states)
        else:
            return None
        for state in states:
            state.num_computed += 1
        scheduled = [(state, 1) for state in states]
        for window in windows:
            window.state.num_computed += window.length
            scheduled.append((window.state, window.length))
        sampled = states + [window.state for window in windows if window.ends_prompt]
        return Taken(batch, sampled, scheduled, self.seconds + time.perf_counter() - started, late)

    def _matches_exactly(self, step: worker_pb2.Step) -> bool:
        running, expected = step.running, self.expected
        return (
            not step.released_seq_ids
            and running.seq_ids == expected.seq_ids
            and running.num_computed_tokens == expected.num_computed_tokens
            and running.num_new_tokens == expected.num_new_tokens
            and running.num_new_blocks == expected.num_new_blocks
            and len(running.new_block_ids)
            == 4 * (len(self.block_rows) + sum(len(window.new_columns) for window in self.windows))
        )

    def _fill_windows(self, blocks: list[int]) -> None:
        """Each window's new blocks (in order), in its tokens' slots, its key slots and its table."""
        slots, tables = self.views[0], self.views[1]
        size = self.batch.block_size
        next_block = iter(blocks)
        for window in self.windows:
            end = window.start + window.length
            for column in window.new_columns:
                block = next(next_block)
                positions = np.arange(max(window.start, column * size), min(end, (column + 1) * size))
                block_slots = block * size + positions % size
                slots[window.token_start + positions - window.start] = block_slots
                window.key_slots[positions] = block_slots
                tables[window.row, column] = block
                window.state.block_table.append(block)

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
        if len(sub_rows):
            blocks = np.frombuffer(step.running.new_block_ids, dtype="<i4").tolist()
            columns = self.new_block_column[rows[sub_rows]].tolist()
            _write_decode_blocks(_views(batch), batch.block_size, sub_rows.tolist(), columns, blocks)
            for row, block in zip(rows[sub_rows].tolist(), blocks, strict=True):
                self.states[row].block_table.append(block)
        return batch, [self.states[row] for row in rows.tolist()]


def _decode_inputs(states: list[SeqState]) -> LateInputs | None:
    """Decode rows 0..D-1's inputs (the tokens step k samples, which it may not have yet): written
    in before the forward (ModelRunner.execute), like a full staging's late inputs."""
    if not states:
        return None
    return LateInputs(
        rows=list(range(len(states))),
        token_lists=[state.token_ids for state in states],
        positions=[state.num_computed for state in states],
    )


def _views(batch: ForwardBatch) -> tuple[np.ndarray, ...]:
    """Slot mapping and block tables, and the decode rows' tables and key blocks when there are
    decode rows: numpy views of the CPU tensors (writes go into the batch)."""
    views = (batch.slot_mapping.numpy(), batch.block_tables.numpy())
    if batch.decode is None:
        return views
    return (*views, batch.decode.block_tables.numpy(), batch.decode.key_blocks.numpy())


def _write_decode_blocks(
    views: tuple[np.ndarray, ...], block_size: int, rows: list[int], columns: list[int], blocks: list[int]
) -> None:
    """Decode rows `rows` start block `blocks[i]` at table column `columns[i]` with their new token."""
    if not rows:
        return
    slots, tables, decode_tables, key_blocks = views
    per_row = decode_tables.shape[1]
    for row, column, block in zip(rows, columns, blocks, strict=True):
        slots[row] = block * block_size  # the new token is the block's first
        tables[row, column] = decode_tables[row, column] = block
        key_blocks[row * per_row + column] = block


def forecast_next_step(
    batch: ForwardBatch | None,
    scheduled: list[tuple[SeqState, int]],
    sampled: list[SeqState],
    sampled_tokens: np.ndarray,
    block_size: int,
) -> StepForecast | None:
    """The successor of the CPU step staged as `batch`, which ran `scheduled` (each sequence with
    its new tokens, in the step's order) and samples `sampled` into `sampled_tokens`: a decode for
    each of those, then the next window of each prompt whose chunk did not end it, as long as that
    chunk (or what is left). None when there is nothing to forecast, or a window of one token
    (its batch row would pass for a decode's)."""
    started = time.perf_counter()
    if batch is None or not scheduled:
        return None
    if (
        not batch.prefills
        and batch.positions.device.type == "cpu"  # its arrays are read (a GPU's: build from chunks)
        and batch.decode is not None
        and batch.decode.num_seqs == len(sampled) == len(scheduled)
        and batch.chunk_order == tuple(range(len(sampled)))
    ):
        return _next_decodes(batch, sampled, sampled_tokens, started)
    sampling = {id(state) for state in sampled}
    chunks = []
    entries = []
    table_lens = np.empty(len(sampled), dtype=np.int64)
    new_block_column = np.full(len(sampled), -1, dtype=np.int64)
    for row, state in enumerate(sampled):
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
    windows = []
    token_start = len(sampled)
    for state, last_length in scheduled:
        if id(state) in sampling:
            continue
        start = state.num_computed
        length = min(len(state.token_ids) - start, last_length)
        if length < 2:
            return None
        covered = len(state.block_table)
        needed = -(-(start + length) // block_size)
        new_columns = list(range(covered, max(covered, needed)))
        ends_prompt = start + length == len(state.token_ids)
        table = [*state.block_table, *([0] * len(new_columns))]
        chunks.append(ScheduledChunk(state.token_ids[start : start + length], start, table, ends_prompt))
        entries.append(RunningEntry(state.seq_id, start, length, [0] * len(new_columns)))
        windows.append((state, start, length, len(chunks) - 1, token_start, new_columns, ends_prompt))
        token_start += length
    expected = pack_running(entries)
    expected.ClearField("new_block_ids")
    forecast_batch = build_forward_batch(chunks, block_size, "cpu")
    if not windows:
        forecast_batch.input_ids = torch.from_numpy(sampled_tokens)  # [D] int64, written by finish
    window_records = []
    for (state, start, length, row, first_token, new_columns, ends_prompt), prefill in zip(
        windows, forecast_batch.prefills, strict=True
    ):
        assert prefill.key_slots is not None and prefill.token_start == first_token, (
            "a window continues a prompt"
        )
        window_records.append(
            _Window(
                state, start, length, row, first_token, new_columns, prefill.key_slots.numpy(), ends_prompt
            )
        )
    num_computed = np.fromiter((s.num_computed for s in sampled), dtype=np.int64, count=len(sampled))
    return _forecast(
        batch=forecast_batch,
        states=sampled,
        windows=window_records,
        expected=expected,
        num_computed=num_computed,
        table_lens=table_lens,
        new_block_column=new_block_column,
        started=started,
    )


def _next_decodes(
    batch: ForwardBatch, states: list[SeqState], sampled_tokens: np.ndarray, started: float
) -> StepForecast | None:
    """The common case, a decode-only step (row i is states[i]), advanced one token in a few array
    operations instead of a build from chunks: every row's position and context one up, its slot
    the next one, a table column more where a row's new token starts a block (block 0 until the
    scheduler names it). Laid out as build_forward_batch lays out the same step."""
    size = batch.block_size
    count = len(states)
    table_lens = np.fromiter((len(s.block_table) for s in states), dtype=np.int64, count=count)
    positions = batch.positions.numpy() + 1  # [D] where step k's sampled tokens go
    covered = table_lens * size
    if (positions > covered).any():
        return None
    new_block = positions == covered
    new_lens = table_lens + new_block
    old_tables = batch.block_tables.numpy()  # [D, W] int32, as wide as the longest table
    tables = np.zeros((count, int(new_lens.max())), dtype=np.int32)
    tables[:, : old_tables.shape[1]] = old_tables
    slots = tables[np.arange(count), positions // size].astype(np.int64) * size + positions % size
    context_lens = (positions + 1).astype(np.int32)
    decode = decode_attention(tables, context_lens, size)
    forecast_batch = ForwardBatch(
        input_ids=torch.from_numpy(sampled_tokens),  # [D] int64, written by finish
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        logits_indices=batch.logits_indices,
        query_start_loc=batch.query_start_loc,
        context_lens=decode.context_lens,
        block_tables=torch.from_numpy(tables),
        chunk_order=batch.chunk_order,
        block_size=size,
        decode=decode,
        prefills=(),
    )
    expected = worker_pb2.RunningSequences(
        seq_ids=np.fromiter((s.seq_id for s in states), dtype="<u8", count=count).tobytes(),
        num_computed_tokens=positions.astype("<u4").tobytes(),
        num_new_tokens=np.ones(count, dtype="<u4").tobytes(),
        num_new_blocks=new_block.astype("<u4").tobytes(),
    )
    new_block_column = np.where(new_block, table_lens, -1)
    return _forecast(
        batch=forecast_batch,
        states=states,
        windows=[],
        expected=expected,
        num_computed=positions,
        table_lens=new_lens,
        new_block_column=new_block_column,
        started=started,
    )


def _forecast(
    *,
    batch: ForwardBatch,
    states: list[SeqState],
    windows: list[_Window],
    expected: worker_pb2.RunningSequences,
    num_computed: np.ndarray,
    table_lens: np.ndarray,
    new_block_column: np.ndarray,
    started: float,
) -> StepForecast:
    """A StepForecast, with what follows from those (rows by sequence, the rows with a new block,
    the batch's views, the seconds since `started`)."""
    block_rows = np.flatnonzero(new_block_column >= 0)
    return StepForecast(
        states=list(states),
        windows=windows,
        row_of={state.seq_id: row for row, state in enumerate(states)},
        expected=expected,
        num_computed=num_computed,
        table_lens=table_lens,
        new_block_column=new_block_column,
        block_rows=block_rows.tolist(),
        block_columns=new_block_column[block_rows].tolist(),
        views=_views(batch),
        batch=batch,
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
        self._by_seq: dict[int, StepForecast] = {}

    def add(self, forecast: StepForecast) -> None:
        for seq_id in [s for s, f in self._by_seq.items() if f.used]:
            del self._by_seq[seq_id]
        self.drop_touching(forecast.seq_ids)
        for seq_id in forecast.seq_ids:
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

    def _remove(self, forecast: StepForecast) -> None:
        for seq_id in forecast.seq_ids:
            if self._by_seq.get(seq_id) is forecast:
                del self._by_seq[seq_id]

    def clear(self) -> None:
        self._by_seq.clear()

    def __len__(self) -> int:
        """Sequences filed, under used forecasts too (they leave at the next `add`)."""
        return len(self._by_seq)

    def filed_under(self) -> set[int]:
        """The sequences forecasts that can still be taken hold."""
        return {seq_id for seq_id, forecast in self._by_seq.items() if not forecast.used}

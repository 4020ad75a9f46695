"""The next decode step, staged while the current one computes (CPU SBO).

A sequence is in at most one in-flight batch, and with the CPU's one decode lane the scheduler
sends decode step k+1 only after step k's result: the message that SBO would stage during step k
does not exist yet. But what it will say is nearly always known: the same sequences in the same
order, one token further on. So right after staging a decode-only step k, the staging thread builds
that successor's batch (positions, slots, block tables, context lengths, attention metadata) and
the running-sequence arrays the scheduler will send for it. When step k+1 arrives with exactly
those arrays, staging is only filling in what could not be known in advance: the tokens step k
sampled, and the blocks the scheduler added for sequences whose new token starts one. Anything
else (a sequence finished, joined, preempted or released, a prefill, a block allocated ahead of
need) and the forecast is dropped and the step staged in full.

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

from gpu_worker.batch import ForwardBatch, ScheduledChunk, build_forward_batch
from protos import worker_pb2
from protos.running import RunningEntry, pack_running

if TYPE_CHECKING:
    from gpu_worker.runner import SeqState


@dataclass(slots=True)
class DecodeForecast:
    """Decode step k+1 of D sequences, built from step k; its batch is complete once `fill` ran."""

    states: list[SeqState]  # step k's sampled sequences, in its logits order
    seq_ids: frozenset[int]
    expected: (
        worker_pb2.RunningSequences
    )  # Step.running as the scheduler will pack it, less the new block ids
    new_block_rows: list[tuple[int, int]]  # (row, block-table column) of each block the scheduler adds
    batch: ForwardBatch  # input ids and those blocks still to fill in
    seconds: float  # spent building it

    def matches(self, step: worker_pb2.Step) -> bool:
        running, expected = step.running, self.expected
        return (
            not step.new_sequences
            and not step.released_seq_ids
            and not step.urgent
            and running.seq_ids == expected.seq_ids
            and running.num_computed_tokens == expected.num_computed_tokens
            and running.num_new_tokens == expected.num_new_tokens
            and running.num_new_blocks == expected.num_new_blocks
            and len(running.new_block_ids) == 4 * len(self.new_block_rows)
        )

    def fill(self, step: worker_pb2.Step) -> None:
        """Complete the batch from `step` (which `matches`) and advance the sequences as a full
        staging would: step k's tokens in, the new blocks appended."""
        batch, states = self.batch, self.states
        # CPU tensors: the numpy views write into them.
        batch.input_ids.numpy()[:] = [state.token_ids[-1] for state in states]
        if self.new_block_rows:
            assert batch.decode is not None
            slots = batch.slot_mapping.numpy()
            tables = batch.block_tables.numpy()
            decode_tables = batch.decode.block_tables.numpy()
            key_blocks = batch.decode.key_blocks.numpy()
            per_row = decode_tables.shape[1]
            blocks = np.frombuffer(step.running.new_block_ids, dtype="<i4").tolist()
            for (row, column), block in zip(self.new_block_rows, blocks, strict=True):
                states[row].block_table.append(block)
                slots[row] = block * batch.block_size  # the new token is the block's first
                tables[row, column] = decode_tables[row, column] = block
                key_blocks[row * per_row + column] = block
        for state in states:
            state.num_computed += 1


def forecast_decode(
    batch: ForwardBatch | None, states: list[SeqState], block_size: int
) -> DecodeForecast | None:
    """The successor of the CPU step staged as `batch` (sampling `states`); None unless that step
    only decodes, each of its sequences sampling."""
    started = time.perf_counter()
    if batch is None or batch.prefills or batch.decode is None or batch.decode.num_seqs != len(states):
        return None
    if batch.num_logits != len(states):
        return None
    chunks = []
    entries = []
    new_block_rows = []
    for row, state in enumerate(states):
        position = state.num_computed  # the token step k samples goes here
        covered = len(state.block_table) * block_size
        if position > covered:
            return None
        table: list[int] = state.block_table
        new_blocks: tuple[int, ...] = ()
        if position == covered:
            new_block_rows.append((row, len(table)))
            table = [*table, 0]  # block 0 stands in for the one the scheduler will add
            new_blocks = (0,)
        chunks.append(ScheduledChunk((0,), position, table, True))
        entries.append(RunningEntry(state.seq_id, position, 1, new_blocks))
    expected = pack_running(entries)
    expected.ClearField("new_block_ids")
    return DecodeForecast(
        states=list(states),
        seq_ids=frozenset(state.seq_id for state in states),
        expected=expected,
        new_block_rows=new_block_rows,
        batch=build_forward_batch(chunks, block_size, "cpu"),
        seconds=time.perf_counter() - started,
    )


class Forecasts:
    """The staging thread's forecasts, filed under their first sequence's id (not by lane: the
    scheduler may send a sequence's next step on either lane).

    Invariant: a forecast's sequences are as they were when it was built. Any step that touches
    one of them other than by taking the forecast drops it (`drop_touching`).
    """

    def __init__(self) -> None:
        self._by_first: dict[int, DecodeForecast] = {}

    def add(self, forecast: DecodeForecast) -> None:
        self._by_first[forecast.states[0].seq_id] = forecast

    def take(self, step: worker_pb2.Step) -> DecodeForecast | None:
        """The forecast of `step`, filled in and removed; None (nothing changed) when there is none."""
        if len(step.running.seq_ids) < 8:
            return None
        first = int.from_bytes(step.running.seq_ids[:8], "little")
        forecast = self._by_first.pop(first, None)
        if forecast is None or not forecast.matches(step):
            return None
        forecast.fill(step)
        self.drop_touching(forecast.seq_ids)
        return forecast

    def drop_touching(self, seq_ids: Iterable[int]) -> None:
        touched = frozenset(seq_ids)
        for first in [
            f for f, forecast in self._by_first.items() if not forecast.seq_ids.isdisjoint(touched)
        ]:
            del self._by_first[first]

    def clear(self) -> None:
        self._by_first.clear()

    def __len__(self) -> int:
        return len(self._by_first)

    def filed_under(self) -> set[int]:
        return set(self._by_first)

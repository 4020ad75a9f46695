"""The next decode step, staged while the current one computes (CPU SBO).

A sequence is in at most one in-flight batch, and with the CPU's one decode lane the scheduler
sends decode step k+1 only after step k's result: the message that SBO would stage during step k
does not exist yet. But what it will say is nearly always known: the same sequences in the same
order, one token further on. So right after staging a decode-only step k, the staging thread builds
the batch of that successor (positions, slots, block tables, context lengths, attention metadata).
When step k+1 arrives and says exactly that, staging is only filling in what could not be known
in advance: the tokens step k sampled, and the blocks the scheduler added for sequences whose new
token starts one. Anything else (a sequence finished, joined, preempted or released, a prefill, a
block allocated ahead of need) and the forecast is dropped and the step staged in full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_worker.batch import ForwardBatch, ScheduledChunk, build_forward_batch
from protos import worker_pb2
from protos.running import Running

if TYPE_CHECKING:
    from gpu_worker.runner import SeqState


@dataclass(slots=True)
class DecodeForecast:
    """Decode step k+1 of D sequences, built from step k; only `take` hands its batch out."""

    lane: int
    states: list[SeqState]  # step k's sampled sequences, in its logits order
    seq_ids: np.ndarray  # [D] uint64
    num_computed: np.ndarray  # [D] int64: each sequence's computed tokens when step k+1 comes
    num_new_blocks: np.ndarray  # [D] int64: 1 where the new token starts a block the scheduler adds
    batch: ForwardBatch  # input ids and those blocks still to fill in
    seconds: float  # spent building it

    def take(
        self, step: worker_pb2.Step, running: Running, seqs: dict[int, SeqState]
    ) -> tuple[ForwardBatch, list[SeqState]] | None:
        """Step k+1's batch and sampled sequences, with the sequences' state advanced as a full
        staging would; None (nothing changed) when `step` is not the forecast one."""
        if (
            step.new_sequences
            or step.released_seq_ids
            or step.urgent
            or step.lane != self.lane
            or not np.array_equal(running.seq_ids, self.seq_ids)
            or not np.array_equal(running.num_computed_tokens, self.num_computed)
            or not (running.num_new_tokens == 1).all()
            or not np.array_equal(running.num_new_blocks, self.num_new_blocks)
        ):
            return None
        for state, computed in zip(self.states, self.num_computed.tolist(), strict=True):
            # Still the state forecast from, step k's token appended, nothing run since.
            if seqs.get(state.seq_id) is not state or state.num_computed != computed:
                return None
            if len(state.token_ids) != computed + 1:
                return None
        batch = self.batch
        batch.input_ids.copy_(torch.tensor([state.token_ids[-1] for state in self.states]))
        rows = np.flatnonzero(self.num_new_blocks)
        if rows.size:
            self._add_blocks(rows, running.new_block_ids)
        for state in self.states:
            state.num_computed += 1
        return batch, self.states

    def _add_blocks(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Rows `rows` start block `blocks[i]` (one each) with their new token, at its offset 0."""
        batch = self.batch
        assert batch.decode is not None
        for row, block in zip(rows.tolist(), blocks.tolist(), strict=True):
            self.states[row].block_table.append(block)
        column = torch.from_numpy(self.num_computed[rows] // batch.block_size)  # [R]
        row_index = torch.from_numpy(rows)
        block_ids = torch.from_numpy(blocks)
        batch.slot_mapping[row_index] = block_ids * batch.block_size
        batch.block_tables[row_index, column] = block_ids.to(torch.int32)
        batch.decode.block_tables[row_index, column] = block_ids.to(torch.int32)
        per_row = batch.decode.block_tables.shape[1]
        batch.decode.key_blocks[row_index * per_row + column] = block_ids


def forecast_decode(
    lane: int, batch: ForwardBatch | None, states: list[SeqState], block_size: int
) -> DecodeForecast | None:
    """The successor of the step staged as `batch` (sampling `states`), on the CPU; None unless
    that step only decodes, each of its sequences sampling."""
    started = time.perf_counter()
    if batch is None or batch.prefills or batch.decode is None or batch.decode.num_seqs != len(states):
        return None
    if batch.num_logits != len(states):
        return None
    chunks = []
    new_blocks = np.zeros(len(states), dtype=np.int64)
    for row, state in enumerate(states):
        position = state.num_computed  # the token step k samples goes here
        covered = len(state.block_table) * block_size
        if position > covered:
            return None
        table: list[int] = state.block_table
        if position == covered:
            new_blocks[row] = 1
            table = [*table, 0]  # block 0 stands in for the one the scheduler will add
        chunks.append(ScheduledChunk((0,), position, table, True))
    forecast_batch = build_forward_batch(chunks, block_size, "cpu")
    return DecodeForecast(
        lane=lane,
        states=list(states),
        seq_ids=np.fromiter((s.seq_id for s in states), dtype=np.uint64, count=len(states)),
        num_computed=np.fromiter((s.num_computed for s in states), dtype=np.int64, count=len(states)),
        num_new_blocks=new_blocks,
        batch=forecast_batch,
        seconds=time.perf_counter() - started,
    )

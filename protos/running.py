"""Step.running both ways: the scheduler packs its running sequences, the worker unpacks them.

worker.proto carries them as parallel packed arrays (RunningSequences) so that a 64-sequence
decode step costs a few array copies on each side rather than 64 sub-messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protos import worker_pb2


@dataclass(frozen=True, slots=True)
class RunningEntry:
    """One running sequence's part of a step, as the scheduler states it."""

    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class Running:
    """Step.running unpacked: R sequences, B new blocks in all."""

    seq_ids: np.ndarray  # [R] uint64, read-only views of the message's bytes
    num_computed_tokens: np.ndarray  # [R] uint32
    num_new_tokens: np.ndarray  # [R] uint32
    num_new_blocks: np.ndarray  # [R] uint32
    new_block_ids: np.ndarray  # [B] int32, sequence after sequence

    def __len__(self) -> int:
        return len(self.seq_ids)

    def blocks_of(self) -> list[list[int]]:
        """Each sequence's new blocks, in order."""
        ends = np.cumsum(self.num_new_blocks).tolist()
        ids = self.new_block_ids.tolist()
        return [ids[end - n : end] for end, n in zip(ends, self.num_new_blocks.tolist(), strict=True)]


def pack_running(entries: Sequence[RunningEntry]) -> worker_pb2.RunningSequences:
    blocks = [block for entry in entries for block in entry.new_block_ids]
    return worker_pb2.RunningSequences(
        seq_ids=np.fromiter((e.seq_id for e in entries), "<u8", len(entries)).tobytes(),
        num_computed_tokens=np.fromiter(
            (e.num_computed_tokens for e in entries), "<u4", len(entries)
        ).tobytes(),
        num_new_tokens=np.fromiter((e.num_new_tokens for e in entries), "<u4", len(entries)).tobytes(),
        num_new_blocks=np.fromiter((len(e.new_block_ids) for e in entries), "<u4", len(entries)).tobytes(),
        new_block_ids=np.asarray(blocks, dtype="<i4").tobytes(),
    )


def unpack_running(message: worker_pb2.RunningSequences) -> Running:
    """Raises ValueError naming the field whose length does not fit."""
    fields = {}
    for name, dtype in (
        ("seq_ids", "<u8"),
        ("num_computed_tokens", "<u4"),
        ("num_new_tokens", "<u4"),
        ("num_new_blocks", "<u4"),
        ("new_block_ids", "<i4"),
    ):
        data = getattr(message, name)
        if len(data) % np.dtype(dtype).itemsize:
            raise ValueError(f"running.{name}: {len(data)} bytes is not a whole number of {dtype} entries")
        fields[name] = np.frombuffer(data, dtype=dtype)
    count = len(fields["seq_ids"])
    for name in ("num_computed_tokens", "num_new_tokens", "num_new_blocks"):
        if len(fields[name]) != count:
            raise ValueError(f"running.{name}: {len(fields[name])} entries for {count} sequences")
    total = int(fields["num_new_blocks"].sum())
    if len(fields["new_block_ids"]) != total:
        raise ValueError(
            f"running.new_block_ids: {len(fields['new_block_ids'])} entries, num_new_blocks add up to {total}"
        )
    return Running(
        seq_ids=fields["seq_ids"],
        num_computed_tokens=fields["num_computed_tokens"],
        num_new_tokens=fields["num_new_tokens"],
        num_new_blocks=fields["num_new_blocks"],
        new_block_ids=fields["new_block_ids"],
    )

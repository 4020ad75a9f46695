"""The generated modules match the .proto files (python -m protos.generate rewrites them)."""

from __future__ import annotations

from protos import worker_pb2
from protos.generate import stale_files
from protos.running import RunningEntry, pack_running, unpack_running


def test_generated_modules_are_up_to_date() -> None:
    assert stale_files() == [], "run `python -m protos.generate`; never edit generated modules by hand"


def test_running_sequences_pack_and_unpack_to_the_same_entries() -> None:
    entries = [
        RunningEntry(7, 40, 1, [12]),
        RunningEntry(2**40 + 3, 17, 32),
        RunningEntry(9, 0, 1, [5, 6, 8]),
    ]
    message = worker_pb2.RunningSequences.FromString(pack_running(entries).SerializeToString())
    running = unpack_running(message)
    assert len(running) == 3
    assert running.seq_ids.tolist() == [7, 2**40 + 3, 9]
    assert running.num_computed_tokens.tolist() == [40, 17, 0]
    assert running.num_new_tokens.tolist() == [1, 32, 1]
    assert running.blocks_of() == [[12], [], [5, 6, 8]]
    assert len(unpack_running(pack_running([]))) == 0

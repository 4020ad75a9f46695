"""BlockManager on tiny pools: exact block ids, no-space as a return value, integrity."""

from __future__ import annotations

import pytest

from scheduler.block_manager import BlockManager


def test_allocate_grows_the_table_block_by_block() -> None:
    blocks = BlockManager(num_blocks=6, block_size=4)
    assert blocks.allocate(seq_id=1, num_tokens=5) == [0, 1]
    assert blocks.allocate(seq_id=1, num_tokens=8) == []  # still fits in two blocks
    assert blocks.allocate(seq_id=1, num_tokens=9) == [2]
    assert blocks.allocate(seq_id=2, num_tokens=1) == [3]
    assert blocks.table(1) == [0, 1, 2]
    assert blocks.num_free_blocks == 2
    blocks.check_integrity()


def test_no_space_is_a_return_value_and_changes_nothing() -> None:
    blocks = BlockManager(num_blocks=3, block_size=4)
    assert blocks.allocate(1, 8) == [0, 1]
    assert blocks.allocate(2, 12) is None
    assert blocks.table(2) == []
    assert blocks.allocate(1, 16) is None  # needs two more, one is free
    assert blocks.table(1) == [0, 1]
    assert blocks.num_free_blocks == 1
    blocks.check_integrity()


def test_freed_blocks_return_and_are_reused_in_queue_order() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2)
    assert blocks.allocate(1, 4) == [0, 1]
    assert blocks.allocate(2, 2) == [2]
    assert blocks.free(1) == 2
    assert blocks.num_free_blocks == 3
    # Block 3 was free before 0 and 1; the tail block (1) of the freed sequence comes back first.
    assert blocks.allocate(3, 6) == [3, 1, 0]
    assert blocks.free(99) == 0  # a sequence that holds nothing
    blocks.check_integrity()


def test_pool_returns_to_full_after_every_sequence_is_freed() -> None:
    blocks = BlockManager(num_blocks=8, block_size=16)
    for seq_id, tokens in enumerate((17, 1, 48, 32)):
        assert blocks.allocate(seq_id, tokens) is not None
    for seq_id in range(4):
        blocks.free(seq_id)
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_integrity()


def test_integrity_check_catches_a_corrupted_pool() -> None:
    blocks = BlockManager(num_blocks=2, block_size=4)
    blocks.allocate(1, 4)
    blocks._free.append(0)  # block 0 is owned by sequence 1 and now also free
    with pytest.raises(AssertionError, match="block 0"):
        blocks.check_integrity()

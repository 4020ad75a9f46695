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


# ------------------------------------------------------------------------------ prefix cache


def run_sequence(blocks: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """Admit like the planner does, compute every token, name the full blocks; returns the cached tokens."""
    cached = blocks.match_prefix(seq_id, tokens)
    assert blocks.allocate(seq_id, len(tokens)) is not None
    blocks.commit(seq_id, tokens, len(tokens))
    return cached


def test_a_shared_prefix_is_reused_block_for_block() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    system = list(range(100, 108))  # two full blocks
    assert run_sequence(blocks, 1, [*system, 1, 2, 3]) == 0
    assert blocks.table(1) == [0, 1, 2]
    # Same two blocks, a different tail: blocks 0 and 1 are shared, only the tail is new.
    assert blocks.match_prefix(2, [*system, 7, 7]) == 8
    assert blocks.table(2) == [0, 1]
    assert blocks.allocate(2, 10) == [3]
    blocks.check_integrity()
    assert blocks._ref_counts[:4] == [2, 2, 1, 1]


def test_at_least_one_token_is_left_to_compute() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    run_sequence(blocks, 1, prompt)
    blocks.free(1)
    assert blocks.match_prefix(2, prompt) == 4  # not 8: the last token's logits are needed
    assert blocks.table(2) == [0]


def test_a_different_earlier_block_changes_every_later_name() -> None:
    blocks = BlockManager(num_blocks=8, block_size=2)
    run_sequence(blocks, 1, [1, 2, 3, 4, 5])
    # Block 2's tokens match, but the block before differs: the chained name differs too.
    assert blocks.match_prefix(2, [9, 9, 3, 4, 5]) == 0
    assert blocks.table(2) == []


def test_cached_blocks_outlive_their_sequence_and_are_evicted_lru_when_space_is_needed() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2)
    run_sequence(blocks, 1, [1, 2, 3, 4])  # blocks 0, 1 named
    run_sequence(blocks, 2, [5, 6, 7])  # block 2 named, block 3 holds the partial tail
    blocks.free(1)
    blocks.free(2)
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 3
    # Never-named block 3 goes first, then the least recently freed cached blocks, tail first.
    assert blocks.allocate(3, 2) == [3]
    assert blocks.allocate(4, 4) == [1, 0]
    blocks.check_integrity()
    assert blocks.match_prefix(5, [1, 2, 3, 4, 9]) == 0  # sequence 1's prefix was evicted
    assert blocks.match_prefix(6, [5, 6, 7]) == 2  # sequence 2's is still cached
    assert blocks.table(6) == [2]
    blocks.check_integrity()


def test_a_hit_takes_the_block_off_the_eviction_list() -> None:
    blocks = BlockManager(num_blocks=3, block_size=2)
    run_sequence(blocks, 1, [1, 2, 3])
    blocks.free(1)
    assert blocks.match_prefix(2, [1, 2, 8]) == 2
    assert blocks.table(2) == [0]
    # Two free blocks remain (1 unnamed, 2 never used); block 0 is owned, so it cannot be evicted.
    assert blocks.allocate(3, 6) is None
    assert blocks.allocate(3, 4) == [2, 1]
    blocks.check_integrity()


def test_the_same_prefix_computed_twice_at_once_is_named_once() -> None:
    blocks = BlockManager(num_blocks=6, block_size=2)
    for seq_id in (1, 2):
        assert blocks.match_prefix(seq_id, [1, 2, 3]) == 0
        assert blocks.allocate(seq_id, 3) is not None
    blocks.commit(1, [1, 2, 3], 3)
    blocks.commit(2, [1, 2, 3], 3)
    blocks.free(1)
    blocks.free(2)
    blocks.check_integrity()
    assert blocks.num_cached_blocks == 1
    assert blocks.match_prefix(3, [1, 2, 3]) == 2


def test_disabled_prefix_cache_never_matches_or_names() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2, prefix_cache=False)
    run_sequence(blocks, 1, [1, 2, 3, 4, 5])
    blocks.free(1)
    assert blocks.num_cached_blocks == 0
    assert blocks.match_prefix(2, [1, 2, 3, 4, 5]) == 0
    blocks.check_integrity()

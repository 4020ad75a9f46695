"""Paged KV-cache block tables: which cache blocks each sequence owns.

The pool is a fixed number of blocks of `block_size` token slots, sized from
what the worker reported. "No space" is an ordinary return value (None) that
the planner reacts to by preempting or waiting, never an exception.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Allocates and frees KV blocks per sequence, with reference counts."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0, f"a KV pool needs at least one block, got {num_blocks}"
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        """The sequence's block ids in position order (empty when it holds none)."""
        return self._tables.get(seq_id, [])

    def allocate(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """Grow the sequence's table to hold `num_tokens` tokens.

        Returns the block ids appended (possibly none), or None when the pool has
        too few free blocks; then nothing changes.
        """
        table = self._tables.setdefault(seq_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing <= 0:
            return []
        if missing > len(self._free):
            if not table:
                del self._tables[seq_id]
            return None
        new_blocks = [self._free.popleft() for _ in range(missing)]
        for block in new_blocks:
            assert self._ref_counts[block] == 0, f"block {block} was free but has references"
            self._ref_counts[block] = 1
        table.extend(new_blocks)
        return new_blocks

    def free(self, seq_id: int) -> int:
        """Release every block the sequence holds; returns how many went back to the pool."""
        table = self._tables.pop(seq_id, [])
        released = 0
        # Freed in reverse so a sequence's tail blocks are reused first and its head
        # blocks stay untouched longest (where a prefix cache would look for them).
        for block in reversed(table):
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, f"block {block} freed more often than allocated"
            if self._ref_counts[block] == 0:
                self._free.append(block)
                released += 1
        return released

    def check_integrity(self) -> None:
        """Assert free + owned == total and that ref counts equal owners."""
        owners = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                owners[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block sits in the free queue twice"
        for block in range(self.num_blocks):
            assert owners[block] == self._ref_counts[block], (
                f"block {block}: ref count {self._ref_counts[block]} but {owners[block]} owners"
            )
            assert (block in free) == (owners[block] == 0), (
                f"block {block} is both free and owned, or neither"
            )

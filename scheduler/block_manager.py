"""Paged KV-cache block tables: which cache blocks each sequence owns, and the prefix cache.

The pool is a fixed number of blocks of `block_size` token slots, sized from what the worker
reported. "No space" is an ordinary return value (None) that the planner reacts to by
preempting or waiting, never an exception.

Prefix cache: once a block is full and its K/V computed, it is named by a hash chained over
the token ids of every block up to and including it, so equal names mean equal prefixes. A
new sequence takes the cached blocks of its longest cached prefix (their reference counts
rise) and only computes the rest. A block whose last owner leaves keeps its name and waits
in an LRU list; allocation takes never-named free blocks first, then evicts the least
recently used cached ones.

Every block is in exactly one of three states: free (no name, no owner), cached (named, no
owner, in the LRU list) or owned (reference count = number of tables holding it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def chain_hash(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The name of a full block: its tokens, and through `parent` every token before them."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"")
    digest.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return digest.digest()


class BlockManager:
    """Allocates and frees KV blocks per sequence, with reference counts and an optional prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        assert num_blocks > 0, f"a KV pool needs at least one block, got {num_blocks}"
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._hash_of: dict[int, BlockHash] = {}  # named blocks
        self._block_of: dict[BlockHash, int] = {}
        self._chains: dict[int, list[BlockHash]] = {}  # names of each sequence's named leading blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a cached prefix and no running sequence."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        """The sequence's block ids in position order (empty when it holds none)."""
        return self._tables.get(seq_id, [])

    def match_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Give a sequence that holds no blocks the cached blocks of its longest cached prefix.

        At least one token is always left to compute (its logits are needed). Returns the
        number of tokens whose K/V the sequence now has cached (a multiple of block_size).
        """
        assert seq_id not in self._tables, f"sequence {seq_id} already holds blocks"
        if not self.prefix_cache:
            return 0
        table: list[int] = []
        chain: list[BlockHash] = []
        parent: BlockHash | None = None
        for index in range((len(token_ids) - 1) // self.block_size):
            start = index * self.block_size
            name = chain_hash(parent, token_ids[start : start + self.block_size])
            block = self._block_of.get(name)
            if block is None:
                break
            table.append(block)
            chain.append(name)
            parent = name
        for block in table:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        if table:
            self._tables[seq_id] = table
            self._chains[seq_id] = chain
        return len(table) * self.block_size

    def allocate(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """Grow the sequence's table to hold `num_tokens` tokens.

        Returns the block ids appended (possibly none), or None when the pool has
        too few free blocks; then nothing changes.
        """
        table = self._tables.setdefault(seq_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing <= 0:
            return []
        if missing > self.num_free_blocks:
            if not table:
                del self._tables[seq_id]
            return None
        new_blocks = [self._take_block() for _ in range(missing)]
        for block in new_blocks:
            assert self._ref_counts[block] == 0, f"block {block} was free but has references"
            self._ref_counts[block] = 1
        table.extend(new_blocks)
        return new_blocks

    def has_uncommitted(self, seq_id: int, num_computed: int) -> bool:
        """True when `commit` would name a block (cheap; lets callers skip building the token list)."""
        if not self.prefix_cache or seq_id not in self._tables:
            return False
        full = min(num_computed // self.block_size, len(self._tables[seq_id]))
        return full > len(self._chains.get(seq_id, ()))

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Name the sequence's blocks that are now full and computed (`num_computed` tokens of `token_ids`)."""
        if not self.prefix_cache:
            return
        table = self._tables.get(seq_id)
        if table is None:
            return
        chain = self._chains.setdefault(seq_id, [])
        full = min(num_computed // self.block_size, len(table))
        parent = chain[-1] if chain else None
        for index in range(len(chain), full):
            start = index * self.block_size
            name = chain_hash(parent, token_ids[start : start + self.block_size])
            block = table[index]
            if name not in self._block_of and block not in self._hash_of:
                self._block_of[name] = block
                self._hash_of[block] = name
            # Else the same prefix is already cached in another block (computed twice at once);
            # this copy stays unnamed and is freed as usual. The chain continues either way.
            chain.append(name)
            parent = name

    def free(self, seq_id: int) -> int:
        """Release every block the sequence holds; returns how many lost their last owner."""
        table = self._tables.pop(seq_id, [])
        self._chains.pop(seq_id, None)
        released = 0
        # Tail first, so that among equally old blocks a prefix's head is evicted last.
        for block in reversed(table):
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, f"block {block} freed more often than allocated"
            if self._ref_counts[block] == 0:
                released += 1
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        return released

    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)  # least recently used
        del self._block_of[self._hash_of.pop(block)]
        return block

    def check_integrity(self) -> None:
        """Assert each block is exactly one of free, cached or owned, and that ref counts equal owners."""
        owners = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                owners[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block sits in the free queue twice"
        assert not free & set(self._evictable), "a block is both free and cached"
        assert len(self._hash_of) == len(self._block_of), "block names and blocks disagree"
        for name, block in self._block_of.items():
            assert self._hash_of.get(block) == name, f"block {block}: name map is inconsistent"
        for block in range(self.num_blocks):
            assert owners[block] == self._ref_counts[block], (
                f"block {block}: ref count {self._ref_counts[block]} but {owners[block]} owners"
            )
            states = (block in free, block in self._evictable, owners[block] > 0)
            assert sum(states) == 1, f"block {block}: free/cached/owned = {states}"
            assert (block in self._evictable) <= (block in self._hash_of), f"cached block {block} has no name"
            assert (block in free) <= (block not in self._hash_of), f"free block {block} still has a name"

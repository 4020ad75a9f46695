"""Property test of the BlockManager: random allocate / prefix match / commit / free / evict keep its invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager

# Few distinct tokens and short prompts, so that prefixes repeat and the cache is exercised.
token = st.integers(min_value=0, max_value=2)
operation = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 5), st.lists(token, min_size=1, max_size=12)),
    st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 4)),
    st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(1, 10),
    block_size=st.sampled_from([1, 2, 4]),
    prefix_cache=st.booleans(),
    operations=st.lists(operation, max_size=40),
)
def test_random_operations_keep_the_pool_consistent(
    num_blocks: int, block_size: int, prefix_cache: bool, operations: list[tuple[str, int, object]]
) -> None:
    blocks = BlockManager(num_blocks, block_size, prefix_cache=prefix_cache)
    live: dict[int, list[int]] = {}  # seq_id -> its tokens, all computed
    for kind, seq_id, argument in operations:
        if kind == "admit" and seq_id not in live:
            tokens = list(argument)  # type: ignore[call-overload]
            cached = blocks.match_prefix(seq_id, tokens)
            assert cached % block_size == 0 and cached < len(tokens)
            assert len(blocks.table(seq_id)) == cached // block_size
            if blocks.allocate(seq_id, len(tokens)) is None:
                blocks.free(seq_id)
            else:
                blocks.commit(seq_id, tokens, len(tokens))
                live[seq_id] = tokens
        elif kind == "grow" and seq_id in live:
            tokens = live[seq_id] + [1] * int(argument)  # type: ignore[call-overload]
            if blocks.allocate(seq_id, len(tokens)) is not None:
                blocks.commit(seq_id, tokens, len(tokens))
                live[seq_id] = tokens
        elif kind == "free":
            blocks.free(seq_id)
            live.pop(seq_id, None)
        blocks.check_integrity()
        owned = {b for s in live for b in blocks.table(s)}
        assert blocks.num_free_blocks + len(owned) == num_blocks  # capacity conserved
        for seq_id, tokens in live.items():
            assert len(blocks.table(seq_id)) == blocks.blocks_for(len(tokens))
    for seq_id in list(live):
        blocks.free(seq_id)
    blocks.check_integrity()
    assert blocks.num_free_blocks == num_blocks

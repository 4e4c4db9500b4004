"""Block pool: null block, LRU free list order, prefix index, ref counts under random use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.core.block_pool import BlockPool, KVCacheBlock, NoFreeBlocksError


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3]
    assert pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    assert pool.usage == 1.0


def test_free_list_puts_cached_blocks_at_tail_and_blank_at_head() -> None:
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(a, 111)
    pool.free_blocks([a, b])  # a cached -> tail, b blank -> head
    assert pool.free_block_ids() == [b.block_id, a.block_id]
    pool.free_blocks([c])
    assert pool.free_block_ids() == [c.block_id, b.block_id, a.block_id]
    # the cached block survives until everything blank is used up
    taken = pool.get_new_blocks(2)
    assert {x.block_id for x in taken} == {b.block_id, c.block_id}
    assert pool.get_cached_block(111) is a
    (again,) = pool.get_new_blocks(1)
    assert again is a and a.block_hash is None
    assert pool.get_cached_block(111) is None
    del d


def test_touch_pulls_idle_cached_block_out_of_free_list() -> None:
    pool = BlockPool(3)
    a, _ = pool.get_new_blocks(2)
    pool.cache_block(a, 7)
    pool.free_blocks([a])
    assert pool.is_free(a) and pool.num_free_blocks == 1
    pool.touch([a])
    assert not pool.is_free(a) and a.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.touch([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and not pool.is_free(a)


def test_duplicate_hash_keeps_first_block_indexed() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 5)
    pool.cache_block(b, 5)
    assert pool.get_cached_block(5) is a and b.block_hash is None


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 9)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(9) is None and pool.num_cached_blocks == 0


_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]), st.integers(0, 7)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 12), ops=_ops)
def test_random_use_keeps_ref_counts_and_free_list_consistent(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    pool = BlockPool(num_blocks)
    tables: list[list[KVCacheBlock]] = []
    for op, arg in ops:
        if op == "alloc":
            n = min(arg, pool.num_free_blocks)
            tables.append(pool.get_new_blocks(n))
        elif op == "free" and tables:
            table = tables.pop(arg % len(tables))
            pool.free_blocks(reversed(table))
        elif op == "cache" and tables:
            table = tables[arg % len(tables)]
            for i, block in enumerate(table):
                pool.cache_block(block, 1000 * arg + i)
        elif op == "hit":
            block = pool.get_cached_block(1000 * arg)
            if block is not None:
                pool.touch([block])
                tables.append([block])
        held: dict[int, int] = {}
        for table in tables:
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids)
            for block_id in ids:
                held[block_id] = held.get(block_id, 0) + 1
        for block in pool.blocks[1:]:
            assert block.ref_cnt == held.get(block.block_id, 0)
            assert pool.is_free(block) == (block.ref_cnt == 0)
            if block.block_hash is not None:
                assert pool.get_cached_block(block.block_hash) is block
        assert 0 not in held and pool.null_block.ref_cnt == 1
    for table in tables:
        pool.free_blocks(table)
    assert pool.num_free_blocks == num_blocks - 1

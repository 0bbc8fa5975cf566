from __future__ import annotations

import pytest

from vllm_lite.core.block_pool import BlockPool


def free_order(pool: BlockPool) -> list[int]:
    ids, block = [], pool.free_queue._head.next_free
    while block is not pool.free_queue._tail:
        ids.append(block.block_id)
        block = block.next_free
    return ids


def test_block_zero_is_reserved_and_allocation_is_fifo() -> None:
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]
    assert pool.get_num_free_blocks() == 2


def test_free_appends_in_given_order_for_lru_eviction() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    pool.free(reversed(blocks))
    assert free_order(pool) == [4, 3, 2, 1]


def test_touch_removes_from_the_middle_and_ref_counts() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    pool.free(blocks)
    pool.touch([blocks[2]])
    assert free_order(pool) == [1, 2, 4, 5]
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 2
    pool.free([blocks[2]])
    assert 3 not in free_order(pool)
    pool.free([blocks[2]])
    assert free_order(pool) == [1, 2, 4, 5, 3]


def test_allocating_a_cached_free_block_evicts_its_hash() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_blocks([a], [111], 0, 1)
    pool.free([a, b])
    assert pool.get_cached_block(111) is a
    pool.allocate(1)  # takes `a`, the least recently freed
    assert pool.get_cached_block(111) is None and a.block_hash is None


def test_over_allocation_raises() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks, 2 free"):
        pool.allocate(3)


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache_blocks([a], [5], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free([a])
    assert pool.reset_prefix_cache() and pool.get_cached_block(5) is None


def test_cache_blocks_enters_new_hashes_only_and_counts_them_in_the_version() -> None:
    pool = BlockPool(6)
    a, b, c, d = pool.allocate(4)
    pool.cache_blocks([a], [10], 0, 1)
    version = pool.cache_version
    # a: cached already; b: a fresh hash; c: the hash b just took (stays private); the null
    # block: never; d: outside start..stop.
    pool.cache_blocks([a, b, c, pool.null_block, d], [11, 12, 12, 13, 14], 0, 4)
    assert pool.cache_version == version + 1
    assert pool.get_cached_block(10) is a and a.block_hash == 10
    assert pool.get_cached_block(12) is b and c.block_hash is None
    assert pool.get_cached_block(13) is None and pool.null_block.block_hash is None
    assert pool.get_cached_block(14) is None and d.block_hash is None

"""Unit tests for vlite.core.block_pool and the free queue of vlite.core.kv_cache_utils (toy sizes)."""

from __future__ import annotations

import pytest

from vlite.core.block_pool import BlockPool
from vlite.core.kv_cache_utils import (NONE_HASH, FreeKVCacheBlockQueue, KVCacheBlock, compute_block_hashes,
                                       hash_block_tokens)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def h(i: int):
    """A distinct fake block hash."""
    return hash_block_tokens(None, [i])


def check_pool(pool: BlockPool) -> None:
    """Free queue and ref counts agree; the map only holds hashed blocks under their own hash."""
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.free_block_queue.num_free_blocks == pool.get_num_free_blocks()
    assert len({id(b) for b in free}) == len(free)
    free_set = {b.block_id for b in free}
    for block in pool.blocks:
        assert (block.ref_cnt == 0) == (block.block_id in free_set), block
        if block.block_id not in free_set:
            assert block.prev_free_block is None and block.next_free_block is None
    for key, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == key


# ---- hashing -----------------------------------------------------------------------------------


def test_hash_chaining_and_extension():
    a = hash_block_tokens(None, [1, 2])
    assert a == hash_block_tokens(NONE_HASH, [1, 2])
    assert len(a) == 32
    b = hash_block_tokens(a, [3, 4])
    assert b != hash_block_tokens(None, [3, 4])  # identity depends on the prefix
    assert hash_block_tokens(a, [3, 4], b"x") != b
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    # Only full blocks are hashed; extending reuses (and appends to) the given list.
    existing: list = []
    out = compute_block_hashes([1, 2, 3, 4, 5], 2, existing)
    assert out is existing and out == [a, b]
    out = compute_block_hashes([1, 2, 3, 4, 5, 6], 2, existing)
    assert out == [a, b, hash_block_tokens(b, [5, 6])]
    assert compute_block_hashes([1], 2, []) == []


# ---- free queue --------------------------------------------------------------------------------


def test_free_queue_order_popleft_append_remove():
    blocks = [KVCacheBlock(i) for i in range(10)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 10
    assert ids(q.get_all_free_blocks()) == list(range(10))

    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 2]
    assert ids(q.get_all_free_blocks()) == list(range(3, 10))

    q.append(blocks[1])
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [3, 4, 5, 6, 7, 8, 9, 1, 0]

    # O(1) unlink from the middle, the head and the tail.
    q.remove(blocks[6])
    q.remove(blocks[3])
    q.remove(blocks[0])
    assert blocks[6].prev_free_block is None and blocks[6].next_free_block is None
    assert ids(q.get_all_free_blocks()) == [4, 5, 7, 8, 9, 1]
    assert q.num_free_blocks == 6
    assert q.popleft().block_id == 4


def test_free_queue_exhaustion_and_refill():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q.popleft_n(3)) == [0, 1, 2]
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(AssertionError):
        q.remove(blocks[1])  # not in the queue
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [2]
    assert q.popleft() is blocks[2]


def test_free_queue_empty_at_construction():
    q = FreeKVCacheBlockQueue([])
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    b = KVCacheBlock(7)
    q.append(b)
    assert q.popleft() is b


# ---- block pool --------------------------------------------------------------------------------


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_from_head_and_usage():
    pool = BlockPool(10)
    assert pool.get_usage() == 0.0
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert free_ids(pool) == list(range(3, 10))
    assert pool.get_num_free_blocks() == 7
    assert pool.get_usage() == pytest.approx(0.3)
    assert pool.get_new_blocks(0) == []
    with pytest.raises(ValueError):
        pool.get_new_blocks(8)
    assert free_ids(pool) == list(range(3, 10))  # a refused request changes nothing
    check_pool(pool)


def test_free_blocks_order_and_refcount():
    pool = BlockPool(10)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.touch([a[0]])  # shared: ref_cnt 2
    assert a[0].ref_cnt == 2
    pool.free_blocks(reversed(a))
    # a[0] still referenced; 2 then 1 go to the tail in the given order.
    assert free_ids(pool) == [5, 6, 7, 8, 9, 2, 1]
    assert a[0].ref_cnt == 1
    pool.free_blocks(b)
    pool.free_blocks([a[0]])
    assert free_ids(pool) == [5, 6, 7, 8, 9, 2, 1, 3, 4, 0]
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks([a[0]])  # double free
    check_pool(pool)


def test_cache_full_blocks_registers_range_only():
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(4)
    hashes = [h(i) for i in range(4)]
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    assert pool.cached_block_hash_to_block == {hashes[0]: blocks[0], hashes[1]: blocks[1]}
    assert blocks[2].block_hash is None and blocks[3].block_hash is None
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=2, num_full_blocks=3)
    assert pool.get_cached_block(hashes[2]) is blocks[2]
    assert pool.get_cached_block(hashes[3]) is None
    assert blocks[1].block_hash == hashes[1]
    check_pool(pool)


def test_cache_full_blocks_duplicate_hash_keeps_first():
    pool = BlockPool(10)
    first = pool.get_new_blocks(1)
    second = pool.get_new_blocks(1)
    pool.cache_full_blocks(first, [h(0)], 0, 1)
    pool.cache_full_blocks(second, [h(0)], 0, 1)
    assert pool.get_cached_block(h(0)) is first[0]
    assert second[0].block_hash is None
    # Freeing and evicting the duplicate does not drop the first one's entry.
    pool.free_blocks(second)
    assert free_ids(pool)[-1] == second[0].block_id
    check_pool(pool)
    assert pool.get_cached_block(h(0)) is first[0]


def test_cache_full_blocks_skips_already_cached_hits():
    pool = BlockPool(10)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(0), h(1)], 0, 2)
    # Another request hits a[0] and owns a fresh block after it.
    pool.touch([a[0]])
    tail = pool.get_new_blocks(1)
    b = [a[0]] + tail
    pool.cache_full_blocks(b, [h(0), h(5)], 0, 2)
    assert a[0].block_hash == h(0) and pool.get_cached_block(h(0)) is a[0]
    assert pool.get_cached_block(h(5)) is tail[0]
    check_pool(pool)


def test_get_new_blocks_evicts_cached_blocks_and_drops_hash():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [h(i) for i in range(4)], 0, 4)
    pool.free_blocks(reversed(blocks))  # free order: 3 2 1 0
    assert free_ids(pool) == [3, 2, 1, 0]
    # Freed cached blocks stay in the map until evicted.
    assert len(pool.cached_block_hash_to_block) == 4
    got = pool.get_new_blocks(2)
    assert ids(got) == [3, 2]
    assert all(b.block_hash is None for b in got)
    assert pool.get_cached_block(h(3)) is None and pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is blocks[1] and pool.get_cached_block(h(0)) is blocks[0]
    assert free_ids(pool) == [1, 0]
    check_pool(pool)


def test_touch_pulls_free_cached_blocks_out_of_queue():
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(3)  # 0 1 2
    pool.cache_full_blocks(blocks, [h(0), h(1), h(2)], 0, 3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    hit = [pool.get_cached_block(h(0)), pool.get_cached_block(h(1))]
    assert hit == blocks[:2]
    pool.touch(hit)
    assert [b.ref_cnt for b in blocks] == [1, 1, 0]
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2]
    assert pool.get_num_free_blocks() == 8
    # A touched block that is already referenced just gains a reference.
    pool.touch(hit[:1])
    assert blocks[0].ref_cnt == 2
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2]
    # Touched blocks are never handed out by get_new_blocks; still cached.
    new = pool.get_new_blocks(8)
    assert ids(new) == [3, 4, 5, 6, 7, 8, 9, 2]
    assert blocks[2].block_hash is None and pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(0)) is blocks[0]
    check_pool(pool)


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2  # untouched
    assert blocks[0].block_hash == h(0)
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks[1:])
    order = free_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert free_ids(pool) == order  # the free order is kept
    check_pool(pool)

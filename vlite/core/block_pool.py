"""BlockPool: owns every KV block, the free queue and the prefix-cache map."""

from __future__ import annotations

from typing import Iterable, Optional

from vlite.core.kv_cache_utils import NULL_BLOCK, BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """Every block is either referenced (ref_cnt > 0) or in the free queue (ref_cnt == 0).

    Full blocks may additionally carry a hash and sit in `cached_block_hash_to_block`; a cached
    block stays reusable after it is freed until it is evicted (popped from the free queue's head
    for a new allocation), which is when its hash is dropped.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their hashes.

        If another block already holds the same hash (two requests computed the same prefix at
        once), the map keeps the first and this block stays uncached.
        """
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block is NULL_BLOCK:
                continue  # a prefix hit (already registered), or a block freed behind a sliding window
            block_hash = block_hashes[i]
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting their cached contents."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: take a reference, pulling free cached blocks out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the given order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, unless `force` (the holders
        then keep their blocks, uncached: only for blocks whose K/V nobody will look up again)."""
        if self.get_num_free_blocks() != self.num_blocks and not force:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

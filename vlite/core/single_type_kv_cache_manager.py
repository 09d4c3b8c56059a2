"""One manager per kind of attention layer (vLLM's SingleTypeKVCacheManager): each KV cache group's block lists.

Every group draws blocks from one shared `BlockPool` (the pool's bytes go where they are needed), and registers
its full blocks in the prefix cache under the block's hash and its group (`group_key`): the same prefix is a
different block in each group. A request's list in every group has one entry per `block_size` tokens.

    FullAttentionManager    keeps every block: a query reads all keys before it.
    SlidingWindowManager    a query at position p reads keys in (p - window, p]; once the request's next query
                            is at c, its blocks wholly before c - window + 1 are never read again and go back to
                            the pool (their K/V stay cached until evicted), `NULL_BLOCK` left in their place so
                            list index = block index still holds. A prefix hit needs only the blocks the first
                            computed query reads.
"""

from __future__ import annotations

from vlite.core.block_pool import BlockPool
from vlite.core.kv_cache_utils import NULL_BLOCK, BlockHash, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """A block's prefix-cache key in KV cache group `group_id` (group 0: the hash itself)."""
    return block_hash if group_id == 0 else BlockHash(block_hash + group_id.to_bytes(2, "little"))


class SingleTypeKVCacheManager:
    window = 0  # 0: every key before the query

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int, enable_caching: bool) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # leading blocks of each request registered in the prefix cache

    def cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.block_pool.get_cached_block(group_key(block_hash, self.group_id))

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query from position `num_computed_tokens` on reads."""
        return 0

    def hit_ok(self, block_hashes: list[BlockHash], num_blocks: int) -> bool:
        """Whether a prefix hit of `num_blocks` blocks can be served: every block a query after it reads is cached
        (the last one at least, even where the window reads none of them: a hit is something found)."""
        first = min(self.num_skipped_blocks(num_blocks * self.block_size), num_blocks - 1)
        return all(self.cached_block(h) is not None for h in block_hashes[first:num_blocks])

    def hit_blocks(self, block_hashes: list[BlockHash], num_blocks: int) -> list[KVCacheBlock]:
        """The hit's blocks, NULL_BLOCK for those nothing will read (not taken)."""
        skipped = min(self.num_skipped_blocks(num_blocks * self.block_size), num_blocks)
        return [NULL_BLOCK] * skipped + [self.cached_block(h) for h in block_hashes[skipped:num_blocks]]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks that left every query's window (sliding window); nothing for full attention."""

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hits: int) -> int:
        return cdiv(num_tokens, self.block_size) - len(self.req_to_blocks.get(request_id, ())) - num_hits

    def cache_full_blocks(self, request_id: str, block_hashes: list[BlockHash], num_full: int) -> None:
        """Register the request's first `num_full` blocks (their tokens known, K/V written this step) in the cache."""
        if not self.enable_caching:
            return
        num_cached = self.num_cached_block.get(request_id, 0)
        if num_full > num_cached:
            keys = [group_key(h, self.group_id) for h in block_hashes[:num_full]] if self.group_id else block_hashes
            self.block_pool.cache_full_blocks(self.req_to_blocks[request_id], keys, num_cached, num_full)
            self.num_cached_block[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so its prefix is evicted last."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def free_beyond(self, request_id: str, keep: int) -> None:
        """Free the request's blocks after its first `keep` (never cached: rejected draft tokens filled them)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(b for b in reversed(tail) if b is not NULL_BLOCK)


class FullAttentionManager(SingleTypeKVCacheManager):
    pass


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int, enable_caching: bool,
                 window: int) -> None:
        if window < 1:
            raise ValueError(f"sliding_window must be positive, got {window}")
        super().__init__(block_pool, block_size, group_id, enable_caching)
        self.window = window

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Blocks behind the window go back to the pool, later ones first, so that the earlier ones (the head of
        every prefix-cache chain through them) are evicted last."""
        req_blocks = self.req_to_blocks.get(request_id)
        if not req_blocks:
            return
        freed = []
        for i in range(min(self.num_skipped_blocks(num_computed_tokens), len(req_blocks)) - 1, -1, -1):
            if req_blocks[i] is NULL_BLOCK:
                break  # the ones before were freed in an earlier step
            freed.append(req_blocks[i])
            req_blocks[i] = NULL_BLOCK
        self.block_pool.free_blocks(freed)

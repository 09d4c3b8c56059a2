"""KVCacheManager: per-request block tables on top of the BlockPool, with prefix caching.

The scheduler talks to it through three calls only: `get_computed_blocks` (prefix-cache lookup),
`allocate_slots` (grow a request's blocks for this step's tokens) and `free`.

Sliding window (`sliding_window`, set when every layer of the model attends through one, e.g.
Mistral): a query at position p reads only keys in (p - window, p], so once a request's next query
is at position c, its blocks wholly before c - window + 1 are never read again. `allocate_slots`
frees them (vLLM's SlidingWindowManager does the same), leaving `NULL_BLOCK` in their place so list
index = block index still holds; a long generation then holds about window / block_size + 1 blocks.
Freed blocks keep their prefix-cache hash until evicted: their K/V are complete and remain valid
for a later request with the same prefix. A prefix hit leaves the hit blocks it would free at once
untouched (NULL_BLOCK), as vLLM does. Models mixing sliding and global layers (Gemma 2/3) share one
block table and keep every block: the global layers read them all.

Linear-attention hybrids (Qwen3.5): a second KV cache group, the layers with a recurrent state, is managed by a
`MambaManager` beside the blocks (a state slot per running request, and states saved at block boundaries for
the prefix cache). Every call below covers both groups: a prefix hit is the longest prefix both can serve,
an admission takes blocks and a slot or neither, a free releases both.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlite.core.block_pool import BlockPool
from vlite.core.kv_cache_utils import NULL_BLOCK, KVCacheBlock, compute_block_hashes, lora_extra_keys
from vlite.core.mamba_manager import MambaManager
from vlite.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    requests: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, num_state_slots: int = 0, num_cached_state_slots: int = 0) -> None:
        """`num_state_slots` > 0: the model has recurrent-state layers; that many slots, the last
        `num_cached_state_slots` of them the prefix cache's."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.state_manager = (MambaManager(num_state_slots - num_cached_state_slots, num_cached_state_slots,
                                           block_size, enable_caching) if num_state_slots else None)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def _block_hashes(self, request: Request) -> list:
        return compute_block_hashes(request.all_token_ids, self.block_size, request.block_hashes,
                                    lora_extra_keys(request.lora_request))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold).

        The last token is always recomputed, so a full hit still yields logits to sample from.
        Requests that want prompt logprobs need every prompt position computed: no lookup. With a
        sliding window, the hit blocks behind the window of the first query to compute come back as
        NULL_BLOCK: not taken, since nothing will read them.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        block_hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        if self.state_manager is not None:  # only as far as a saved state reaches
            del hit[self.state_manager.longest_hit(block_hashes, len(hit)):]
        num_hit_tokens = len(hit) * self.block_size
        num_skipped = min(self._num_skipped_blocks(num_hit_tokens), len(hit))
        return [NULL_BLOCK] * num_skipped + hit[num_skipped:], num_hit_tokens

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query from position `num_computed_tokens` on reads (sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _free_skipped_blocks(self, req_blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Free the blocks that left the window of the request's next query, replacing them with NULL_BLOCK.

        Later blocks are freed first, so that the earlier ones (the head of every prefix-cache chain
        through them) are evicted last.
        """
        freed = []
        for i in range(min(self._num_skipped_blocks(num_computed_tokens), len(req_blocks)) - 1, -1, -1):
            if req_blocks[i] is NULL_BLOCK:
                break  # the ones before were freed in an earlier step
            freed.append(req_blocks[i])
            req_blocks[i] = NULL_BLOCK
        self.block_pool.free_blocks(freed)

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None, *, delay_cache_blocks: bool = False,
                       record_stats: bool = True) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Returns the newly allocated blocks, or None (changing nothing) when the pool cannot
        supply them; the caller then preempts or skips. Full blocks whose tokens are known after
        this step are registered in the prefix cache right away, so a request scheduled later in
        the same step can share them (their K/V are written before any attention reads them).
        `delay_cache_blocks`: not yet (blocks a KV connector loads in the background: registered by
        `cache_blocks` once loaded). `record_stats`: count this admission in the prefix-cache stats
        (not when a request whose load finished is admitted again).
        """
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request.request_id)
        is_admission = req_blocks is None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        if self.sliding_window is not None and req_blocks:
            # Blocks behind the window go back to the pool first, whether or not this step fits.
            self._free_skipped_blocks(req_blocks, num_computed_tokens)
        num_required_blocks = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_required_blocks - len(req_blocks) - len(new_computed_blocks)
        if num_new_blocks <= 0 and not new_computed_blocks and not is_admission:
            # The common decode step: the last block still has room. Only caching may change.
            self._cache_full_blocks(request, req_blocks, num_computed_tokens + num_new_tokens)
            return []
        # Hit blocks sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not NULL_BLOCK)
        state = self.state_manager
        no_slot = (state is not None and is_admission and state.slot(request.request_id) < 0
                   and not state.free_slots)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits or no_slot:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if state is not None and is_admission:
            state.allocate(request.request_id, self._block_hashes(request), num_computed_tokens)

        if is_admission and self.enable_caching and record_stats:
            # Counted once per (re)admission, not per retry of a request that did not fit.
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_new_computed_tokens
        if new_computed_blocks:
            self.block_pool.touch(b for b in new_computed_blocks if b is not NULL_BLOCK)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self._cache_full_blocks(request, req_blocks, num_computed_tokens + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks within its first `num_tokens` tokens in the prefix cache (their
        K/V are now in place: loaded by a KV connector)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None:
            self._cache_full_blocks(request, blocks, num_tokens)

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens_after: int) -> None:
        """Register the blocks that this step fills (their tokens are all known) in the prefix cache."""
        if not self.enable_caching:
            return
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = min(num_tokens_after, request.num_tokens) // self.block_size
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(req_blocks, self._block_hashes(request), num_cached, num_full)
            self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix is evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        if self.state_manager is not None:
            self.state_manager.free(request.request_id)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first `num_tokens` tokens (speculative decoding: blocks
        that only rejected draft tokens filled). They were never cached: only verified tokens are hashed."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(b for b in reversed(tail) if b is not NULL_BLOCK)

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        """Leading blocks of `request` (any running one) that every running request references: the
        shared prefix whose attention cascade attention computes once for the whole batch.

        Only running requests hold references (finished and preempted ones released theirs, cached
        free blocks have ref_cnt 0, and a request's list never holds a block twice), so a block with
        ref_cnt == num_running_requests is in every running request's list, at the same index since a
        shared block is a prefix-cache hit on a chained hash. Running requests not scheduled this step
        still count (as in vLLM): a prefix they do not share gives 0 even if every scheduled one shares
        it. With one running request every block counts, the last, partly filled one included, and a
        counted block may hold tokens some request has not computed yet: the attention side must cap
        the prefix at the batch's fewest computed tokens (vLLM's runner does).

        Sliding window: 0, as vLLM's SlidingWindowManager. Leading blocks become NULL_BLOCK as they
        leave the window, and a shared prefix read by every query ignores each query's window.
        """
        if self.sliding_window is not None or num_running_requests <= 0 or self.state_manager is not None:
            return 0  # (recurrent-state models: the step's attention layers alone would share it; not done yet)
        num_common = 0
        for block in self.req_to_blocks.get(request.request_id, ()):
            if block is NULL_BLOCK or block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return num_common

    def get_num_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self, force: bool = False) -> bool:
        reset = self.block_pool.reset_prefix_cache(force)
        if reset and self.state_manager is not None:
            self.state_manager.reset()
        return reset

    # ---- the recurrent-state group ------------------------------------------------------------------------

    def cap_new_tokens(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """This step's tokens for the request, cut where the recurrent-state group must end a step (a prompt's
        last block boundary, whose state the prefix cache saves); unchanged for models without one."""
        if self.state_manager is None:
            return num_new_tokens
        return self.state_manager.cap_new_tokens(request.num_prompt_tokens, num_computed_tokens, num_new_tokens)

    def schedule_state_save(self, request: Request) -> tuple[int, int] | None:
        """After this step's tokens (request.num_computed_tokens already counts them): the (slot, cache slot) copy
        that saves its state at a block boundary for the prefix cache, or None."""
        if self.state_manager is None:
            return None
        return self.state_manager.schedule_save(request.request_id, self._block_hashes(request),
                                                request.num_computed_tokens, request.num_prompt_tokens)

    def state_slot(self, request_id: str) -> int:
        return self.state_manager.slot(request_id) if self.state_manager is not None else -1

    def state_restore_source(self, request_id: str) -> int:
        return self.state_manager.restore_source(request_id) if self.state_manager is not None else -1

    def new_step(self) -> None:
        """The previous step ran: the states it saved are now in the prefix cache."""
        if self.state_manager is not None:
            self.state_manager.commit()


class EncoderOnlyKVCacheManager(KVCacheManager):
    """For models that keep no KV cache (bidirectional encoders: a prompt is computed whole in one step and
    nothing of it is read again): every allocation succeeds with no block, and nothing is cached."""

    def __init__(self, block_size: int) -> None:
        super().__init__(1, block_size, enable_caching=False)  # one block nobody takes: the usage stays 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None, *, delay_cache_blocks: bool = False,
                       record_stats: bool = True) -> list[KVCacheBlock] | None:
        self.req_to_blocks.setdefault(request.request_id, [])
        return []

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        return 0  # no blocks: nothing to share

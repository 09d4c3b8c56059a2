"""KVCacheManager: per-request block tables on top of the BlockPool, with prefix caching, over KV cache groups.

The scheduler talks to it through three calls only: `get_computed_blocks` (prefix-cache lookup),
`allocate_slots` (grow a request's blocks for this step's tokens) and `free`.

Sliding window (`sliding_window`, set when every layer of the model attends through one, e.g.
Mistral): a query at position p reads only keys in (p - window, p], so once a request's next query
is at position c, its blocks wholly before c - window + 1 are never read again. `allocate_slots`
frees them (vLLM's SlidingWindowManager does the same), leaving `NULL_BLOCK` in their place so list
index = block index still holds; a long generation then holds about window / block_size + 1 blocks.
Freed blocks keep their prefix-cache hash until evicted: their K/V are complete and remain valid
for a later request with the same prefix. A prefix hit leaves the hit blocks it would free at once
untouched (NULL_BLOCK), as vLLM does.

KV cache groups (vLLM's hybrid KV cache manager): models mixing sliding and global layers (Gemma 2/3, gpt-oss)
get one group per kind and per `group_windows` entry (vlite.core.kv_cache_interface), each with its own
manager (`FullAttentionManager`, `SlidingWindowManager`: vlite/core/single_type_kv_cache_manager.py) and block
table, all drawing on one pool: the sliding groups' blocks return to it as they leave the window. Every call
below spans the groups: a prefix hit is the longest prefix every group can serve, an allocation takes blocks
in every group or in none, a free releases them all.

Linear-attention hybrids (Qwen3.5): a second KV cache group, the layers with a recurrent state, is managed by a
`MambaManager` beside the blocks (a state slot per running request, and states saved at block boundaries for
the prefix cache). Every call below covers both groups: a prefix hit is the longest prefix both can serve,
an admission takes blocks and a slot or neither, a free releases both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from vlite.core.block_pool import BlockPool
from vlite.core.kv_cache_utils import NULL_BLOCK, KVCacheBlock, compute_block_hashes, lora_extra_keys
from vlite.core.mamba_manager import MambaManager
from vlite.core.single_type_kv_cache_manager import (FullAttentionManager, SingleTypeKVCacheManager,
                                                     SlidingWindowManager, cdiv)
from vlite.request import Request

__all__ = ["KVCacheManager", "EncoderOnlyKVCacheManager", "KVCacheBlocks", "PrefixCacheStats", "cdiv"]


class KVCacheBlocks(list):
    """Blocks of one request in every KV cache group (`per_group`), the list itself being group 0's (the only
    group of most models: what callers that know one group read)."""

    per_group: tuple[list[KVCacheBlock], ...]

    def __init__(self, per_group: Sequence[list[KVCacheBlock]]) -> None:
        super().__init__(per_group[0])
        self.per_group = tuple(per_group)

    def block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks] for blocks in self.per_group)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    requests: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, num_state_slots: int = 0, num_cached_state_slots: int = 0,
                 group_windows: Optional[Sequence[int]] = None) -> None:
        """`group_windows`: one entry per attention group, its window (0: full attention); default: one group,
        sliding where `sliding_window` is set. `num_state_slots` > 0: the model has recurrent-state layers;
        that many slots, the last `num_cached_state_slots` of them the prefix cache's."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        if group_windows is None:
            group_windows = (sliding_window or 0,)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window if len(group_windows) == 1 else None
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.groups: list[SingleTypeKVCacheManager] = [
            SlidingWindowManager(self.block_pool, block_size, g, enable_caching, w) if w
            else FullAttentionManager(self.block_pool, block_size, g, enable_caching)
            for g, w in enumerate(group_windows)]
        self.prefix_cache_stats = PrefixCacheStats()
        self.state_manager = (MambaManager(num_state_slots - num_cached_state_slots, num_cached_state_slots,
                                           block_size, enable_caching) if num_state_slots else None)

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's block lists (the only group of most models)."""
        return self.groups[0].req_to_blocks

    @property
    def num_cached_block(self) -> dict[str, int]:
        return self.groups[0].num_cached_block

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

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold).

        The last token is always recomputed, so a full hit still yields logits to sample from.
        Requests that want prompt logprobs need every prompt position computed: no lookup. Full-attention
        groups need every block of the prefix, sliding ones only those their first computed query reads (the
        others come back as NULL_BLOCK: not taken), the recurrent-state group a state saved at its end.
        """
        none = KVCacheBlocks([[] for _ in self.groups])
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return none, 0
        block_hashes = self._block_hashes(request)
        num = (request.num_tokens - 1) // self.block_size
        full = [g for g in self.groups if not g.window]
        for g in full:  # left to right: the longest prefix of cached blocks
            n = 0
            while n < num and g.cached_block(block_hashes[n]) is not None:
                n += 1
            num = n
        state, sliding = self.state_manager, [g for g in self.groups if g.window]
        while num > 0 and not (all(g.hit_ok(block_hashes, num) for g in sliding)
                               and (state is None or state.longest_hit(block_hashes, num) == num)):
            num -= 1
        if num == 0:
            return none, 0
        return KVCacheBlocks([g.hit_blocks(block_hashes, num) for g in self.groups]), num * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None, *, delay_cache_blocks: bool = False,
                       record_stats: bool = True) -> Optional[KVCacheBlocks]:
        """Make room for `num_new_tokens` more tokens after the computed ones, in every group.

        Returns the newly allocated blocks, or None (changing nothing) when the pool cannot
        supply them; the caller then preempts or skips. Full blocks whose tokens are known after
        this step are registered in the prefix cache right away, so a request scheduled later in
        the same step can share them (their K/V are written before any attention reads them).
        `delay_cache_blocks`: not yet (blocks a KV connector loads in the background: registered by
        `cache_blocks` once loaded). `record_stats`: count this admission in the prefix-cache stats
        (not when a request whose load finished is admitted again).
        """
        req_id = request.request_id
        hits = (new_computed_blocks.per_group if isinstance(new_computed_blocks, KVCacheBlocks)
                else (list(new_computed_blocks or []),) + tuple([] for _ in self.groups[1:]))
        is_admission = req_id not in self.groups[0].req_to_blocks
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        if not is_admission:
            # Blocks behind the window go back to the pool first, whether or not this step fits.
            for g in self.groups:
                g.remove_skipped_blocks(req_id, num_computed_tokens)
        num_tokens = num_computed_tokens + num_new_tokens
        need = [g.num_new_blocks(req_id, num_tokens, len(h)) for g, h in zip(self.groups, hits)]
        has_hits = any(hits)
        if not is_admission and not has_hits and max(need) <= 0:
            # The common decode step: the last block still has room. Only caching may change.
            self._cache_full_blocks(request, num_tokens)
            return KVCacheBlocks([[] for _ in self.groups])
        # Hit blocks sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for h in hits for b in h if b.ref_cnt == 0 and b is not NULL_BLOCK)
        state = self.state_manager
        no_slot = state is not None and is_admission and state.slot(req_id) < 0 and not state.free_slots
        if sum(max(n, 0) for n in need) > self.block_pool.get_num_free_blocks() - num_free_hits or no_slot:
            return None
        if state is not None and is_admission:
            state.allocate(req_id, self._block_hashes(request), num_computed_tokens)
        if is_admission and self.enable_caching and record_stats:
            # Counted once per (re)admission, not per retry of a request that did not fit.
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_new_computed_tokens
        for g, h in zip(self.groups, hits):  # every group's hits first: no group's new blocks may evict them
            g.req_to_blocks.setdefault(req_id, []).extend(h)
            self.block_pool.touch(b for b in h if b is not NULL_BLOCK)
        new = []
        for g, n in zip(self.groups, need):
            blocks = self.block_pool.get_new_blocks(n) if n > 0 else []
            g.req_to_blocks[req_id].extend(blocks)
            new.append(blocks)
        if not delay_cache_blocks:
            self._cache_full_blocks(request, num_tokens)
        return KVCacheBlocks(new)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks within its first `num_tokens` tokens in the prefix cache (their
        K/V are now in place: loaded by a KV connector)."""
        if request.request_id in self.groups[0].req_to_blocks:
            self._cache_full_blocks(request, num_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens_after: int) -> None:
        """Register the blocks that this step fills (their tokens are all known) in the prefix cache."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens_after, request.num_tokens) // self.block_size
        if num_full > self.groups[0].num_cached_block.get(request.request_id, 0):
            hashes = self._block_hashes(request)
            for g in self.groups:
                g.cache_full_blocks(request.request_id, hashes, num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks (every group, each tail first, so its prefix is evicted last) and state."""
        for g in self.groups:
            g.free(request.request_id)
        if self.state_manager is not None:
            self.state_manager.free(request.request_id)

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first `num_tokens` tokens (speculative decoding: blocks
        that only rejected draft tokens filled). They were never cached: only verified tokens are hashed."""
        for g in self.groups:
            g.free_beyond(request.request_id, cdiv(num_tokens, self.block_size))

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

        Only for a model of one full-attention group: 0 with a sliding window (as vLLM's SlidingWindowManager:
        leading blocks become NULL_BLOCK, and a shared prefix read by every query ignores each query's window),
        with several groups or with recurrent-state layers (not done yet).
        """
        if (len(self.groups) > 1 or self.groups[0].window or num_running_requests <= 0
                or self.state_manager is not None):
            return 0
        num_common = 0
        for block in self.req_to_blocks.get(request.request_id, ()):
            if block is NULL_BLOCK or block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return num_common

    def get_num_blocks(self, request_id: str) -> int:
        """Blocks (one per block_size tokens) the request holds in each group."""
        return len(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids (the only group of most models; the KV connector's)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids in every group: one block table per group in the runner."""
        return tuple([b.block_id for b in g.req_to_blocks.get(request_id, [])] for g in self.groups)

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

    def is_partial_prefill(self, request: Request, num_tokens_after: int) -> bool:
        """Mid-prompt after this step, for the scheduler's max_num_partial_prefills: a stop at the recurrent state's
        save boundary does not count (the prompt's last block follows next step; counted, it let one prompt start
        a step: 16 prompts of 128 tokens took 16 steps instead of 2)."""
        if num_tokens_after >= request.num_prompt_tokens:
            return False
        return self.state_manager is None or not self.state_manager.ends_at_save(request.num_prompt_tokens,
                                                                                  num_tokens_after)

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

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        return KVCacheBlocks([[]]), 0

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None, *, delay_cache_blocks: bool = False,
                       record_stats: bool = True) -> Optional[KVCacheBlocks]:
        self.req_to_blocks.setdefault(request.request_id, [])
        return KVCacheBlocks([[]])

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        return 0  # no blocks: nothing to share

"""MambaManager: the recurrent-state group's manager (vLLM's MambaManager, with "align" prefix caching).

A linear-attention layer's state has a fixed size per request, whatever its length, so the group hands out
slots, not blocks: slots [0, num_running) to running requests (one each, taken at admission and given back when
the request finishes or is preempted), slots [num_running, num_slots) to the prefix cache. A fresh slot starts
from zeros (the runner clears it); the runner's state tensors are indexed by these slot numbers.

Prefix caching: a state is only known where a step ends, so prompts are cut to end a step at their last block
boundary (`cap_new_tokens`, vLLM's "align" mode), and the step that ends there saves the request's state into
a cache slot under the hash of the block it completes (`schedule_save`: copied by the runner after the
forward; found by lookups from the next step on). That boundary is the longest prefix a repeated prompt, or
the next turn of a conversation, can reuse; the cache slots are few (each a whole request's state), so no
other boundary takes one. A prefix hit is then the longest one
that the attention blocks and a saved state both cover (`longest_hit`); the request's slot starts as a copy of
that state (`restore_source`). A hit that would end anywhere else is cut back to the last saved boundary, or to
nothing: a state is never reused for tokens it did not see.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from vlite.core.kv_cache_utils import BlockHash


class MambaManager:
    def __init__(self, num_running_slots: int, num_cached_slots: int, block_size: int, enable_caching: bool) -> None:
        if num_running_slots < 1:
            raise ValueError(f"the recurrent state needs at least one slot, got {num_running_slots}")
        self.block_size = block_size
        self.enable_caching = enable_caching and num_cached_slots > 0
        self.num_running_slots = num_running_slots
        self.free_slots = list(range(num_running_slots - 1, -1, -1))  # popped from the end: lowest first
        self.req_to_slot: dict[str, int] = {}
        # block hash -> cache slot holding the state after that block, least recently used first
        self.cached: OrderedDict[BlockHash, int] = OrderedDict()
        self.free_cache_slots = list(range(num_running_slots + num_cached_slots - 1, num_running_slots - 1, -1))
        self._pending: list[tuple[BlockHash, int]] = []  # saved by the step being run: usable from the next one
        self._restore: dict[str, int] = {}  # req_id -> cache slot its state starts from (this step's admissions)

    # ---- lookups and slots -------------------------------------------------------------------------------

    def longest_hit(self, block_hashes: list[BlockHash], num_hit_blocks: int) -> int:
        """Of the first `num_hit_blocks` blocks (those the attention layers can serve), how many lead to a saved state."""
        if not self.enable_caching:
            return 0
        for n in range(num_hit_blocks, 0, -1):
            if block_hashes[n - 1] in self.cached:
                return n
        return 0

    def allocate(self, request_id: str, block_hashes: list[BlockHash], num_computed_tokens: int) -> bool:
        """A slot for a request being admitted with `num_computed_tokens` from the prefix cache (a block boundary
        with a saved state, or 0); False where no slot is free."""
        if request_id in self.req_to_slot:
            return True
        if not self.free_slots:
            return False
        self.req_to_slot[request_id] = self.free_slots.pop()
        if num_computed_tokens:
            block_hash = block_hashes[num_computed_tokens // self.block_size - 1]
            slot = self.cached[block_hash]
            self.cached.move_to_end(block_hash)
            self._restore[request_id] = slot
        return True

    def restore_source(self, request_id: str) -> int:
        """The cache slot the request's state is copied from before this step (-1: it starts from zeros)."""
        return self._restore.pop(request_id, -1)

    def slot(self, request_id: str) -> int:
        return self.req_to_slot.get(request_id, -1)

    def free(self, request_id: str) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        self._restore.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    # ---- saving states at block boundaries ----------------------------------------------------------------

    def cap_new_tokens(self, num_prompt_tokens: int, num_computed_tokens: int, num_new_tokens: int) -> int:
        """A prompt chunk cut to end at the prompt's last block boundary when it would run past it (that boundary
        is the longest prefix a later request with the same prompt can reuse)."""
        if not self.enable_caching:
            return num_new_tokens
        boundary = (num_prompt_tokens - 1) // self.block_size * self.block_size
        if num_computed_tokens < boundary < num_computed_tokens + num_new_tokens:
            return boundary - num_computed_tokens
        return num_new_tokens

    def ends_at_save(self, num_prompt_tokens: int, num_tokens_after: int) -> bool:
        """Whether a step that leaves the request at `num_tokens_after` stopped at the boundary cap_new_tokens cuts at
        (only the prompt's last block is left, for the next step)."""
        return (self.enable_caching and num_tokens_after < num_prompt_tokens
                and num_tokens_after == (num_prompt_tokens - 1) // self.block_size * self.block_size)

    def schedule_save(self, request_id: str, block_hashes: list[BlockHash], num_tokens_after: int,
                      num_prompt_tokens: int) -> Optional[tuple[int, int]]:
        """(request's slot, cache slot) to copy after this step, where the step ends at the prompt's last block
        boundary and that state is not saved yet; else None."""
        if (not self.enable_caching or not num_tokens_after
                or num_tokens_after != (num_prompt_tokens - 1) // self.block_size * self.block_size
                or request_id not in self.req_to_slot):
            return None
        block_hash = block_hashes[num_tokens_after // self.block_size - 1]
        if block_hash in self.cached or any(h == block_hash for h, _ in self._pending):
            return None
        if self.free_cache_slots:
            dst = self.free_cache_slots.pop()
        elif self.cached:
            _, dst = self.cached.popitem(last=False)  # the least recently used saved state
        else:
            return None  # every cache slot is being written this step
        self._pending.append((block_hash, dst))
        return self.req_to_slot[request_id], dst

    def commit(self) -> None:
        """The last step ran: the states it saved can be found."""
        for block_hash, slot in self._pending:
            self.cached[block_hash] = slot
        self._pending = []

    def reset(self) -> None:
        """Forget every saved state (the prefix cache was reset, or a step failed before its saves were made)."""
        self.free_cache_slots.extend(slot for _, slot in self._pending)
        self.free_cache_slots.extend(self.cached.values())
        self._pending = []
        self.cached.clear()

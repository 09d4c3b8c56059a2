"""KV blocks, the free-block queue that encodes eviction order, and prefix-block hashing."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType, Optional, Sequence

if TYPE_CHECKING:
    from vlite.lora.request import LoRARequest

# sha256 over (parent hash, token ids as int32, extra keys): collision resistant, so a hit can be
# trusted without comparing tokens, and fast (C) for the few dozen blocks of a prompt.
BlockHash = NewType("BlockHash", bytes)

NONE_HASH = BlockHash(b"\x00" * 32)


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: Sequence[int],
                      extra_keys: bytes = b"") -> BlockHash:
    """Chained hash: a block's identity is its tokens plus everything before it."""
    h = hashlib.sha256(parent_hash or NONE_HASH)
    h.update(array("i", token_ids).tobytes())
    if extra_keys:
        h.update(extra_keys)
    return BlockHash(h.digest())


def lora_extra_keys(lora_request: Optional[LoRARequest]) -> bytes:
    """What a request's adapter adds to each of its block hashes: its name, id and path, each length-prefixed
    (no two adapters give the same bytes), so K/V computed under one adapter, or under none, are never served
    to a request under another. No adapter: nothing, so the base model's hashes are those without LoRA."""
    if lora_request is None:
        return b""
    parts = (b"lora", lora_request.lora_name.encode(), str(lora_request.lora_int_id).encode(),
             lora_request.lora_path.encode())
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def compute_block_hashes(token_ids: Sequence[int], block_size: int, existing: list[BlockHash],
                         extra_keys: bytes = b"") -> list[BlockHash]:
    """Extend `existing` (hashes of the first full blocks) to cover every full block of token_ids."""
    hashes = existing
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is full and registered in the prefix cache.
    block_hash: Optional[BlockHash] = None
    # Links of the free queue; None while the block is in use.
    prev_free_block: Optional[KVCacheBlock] = None
    next_free_block: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


# Stands in a request's block list for a block freed because it left the sliding window of every layer
# (KVCacheManager with sliding_window): list positions stay token positions. Never in the pool, never
# allocated; its id -1 in a block table is never read (attention starts at the window's first block).
NULL_BLOCK = KVCacheBlock(-1)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order: the head is evicted first.

    A freed block goes to the tail, so the least recently freed block is reused first; a cached
    free block that gets a prefix hit again is unlinked from the middle in O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels keep the link code free of edge cases
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, self._tail.prev_free_block = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free KV blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self._tail.prev_free_block = self._tail, block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; for tests and debugging."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out

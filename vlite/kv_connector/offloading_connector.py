"""OffloadingConnector: the disk store (vlite.kv_connector.disk_store) as a KV connector.

Scheduler side (this module, no torch): a waiting request's full prompt blocks past its local prefix-cache
hit are looked up in the store by their prefix hashes; the run of consecutive blocks found there (never the
block holding the last prompt token) is loaded asynchronously into blocks allocated for it. Every full block
a step computes is saved, unless this process knows it is stored already. Worker side: OffloadingWorker
(offloading_worker.py), built on first use so that the engine core never imports torch for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from vlite.core.kv_cache_utils import NULL_BLOCK, compute_block_hashes, lora_extra_keys
from vlite.kv_connector.base import (BlockTransfer, KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                     KVConnectorRole, KVConnectorStats)
from vlite.kv_connector.disk_store import DiskKVStore

if TYPE_CHECKING:
    from vlite.core.kv_cache_manager import KVCacheManager
    from vlite.core.sched.output import SchedulerOutput
    from vlite.kv_connector.offloading_worker import OffloadingWorker
    from vlite.request import Request

# Hashes remembered as stored (not saved again); past this many the memory is dropped and rebuilt.
_MAX_KNOWN_HASHES = 1 << 20


class OffloadingConnector(KVConnectorBase):
    """`stores`: the scheduler's view, one store per tensor-parallel rank (a block is a hit only when every
    rank has its part); a worker's: its own rank's store."""

    def __init__(self, role: KVConnectorRole, stores: list[DiskKVStore], block_size: int) -> None:
        super().__init__(role)
        self.stores = stores
        self.block_size = block_size
        self._load_specs: dict[str, list[BlockTransfer]] = {}  # allocated since the last step's metadata
        self._no_retry: set[str] = set()  # requests whose load failed: they compute the rest
        self._known: set[bytes] = set()  # hashes stored (or being stored) as far as this process knows
        self._stats = KVConnectorStats()
        self._worker: Optional[OffloadingWorker] = None

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._no_retry or request.sampling_params.prompt_logprobs is not None:
            return 0, False  # prompt logprobs need every position computed (as for local hits)
        bs = self.block_size
        hashes = compute_block_hashes(request.all_token_ids, bs, request.block_hashes,
                                      lora_extra_keys(request.lora_request))
        num_found = 0
        for block_hash in hashes[num_computed_tokens // bs:(request.num_tokens - 1) // bs]:
            if not all(store.contains(block_hash) for store in self.stores):
                break
            num_found += 1
        return num_found * bs, num_found > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        self._stats.queries += request.num_tokens
        self._stats.hits += num_external_tokens
        if num_external_tokens:
            first, n = num_local_tokens // self.block_size, num_external_tokens // self.block_size
            self._load_specs[request.request_id] = [(request.block_hashes[i], block_ids[i])
                                                    for i in range(first, first + n)]

    def load_failed(self, request: Request) -> None:
        """Part of the request's load failed: it computes those tokens, and is not offered the store again."""
        self._no_retry.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                             kv_cache_manager: KVCacheManager) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._load_specs)
        self._load_specs = {}
        if len(self._known) > _MAX_KNOWN_HASHES:
            self._known.clear()
        bs = self.block_size
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            # Full blocks of known tokens (not drafts) that this step's tokens complete.
            end = min(request.num_computed_tokens, request.num_tokens) // bs
            start = (request.num_computed_tokens - num_new) // bs
            if end <= start:
                continue
            blocks = kv_cache_manager.req_to_blocks[req_id]
            for i in range(start, end):
                block_hash = request.block_hashes[i]
                if block_hash in self._known or blocks[i] is NULL_BLOCK:
                    continue
                self._known.add(block_hash)
                meta.saves.append((block_hash, blocks[i].block_id))
        return meta

    def request_finished(self, request: Request) -> None:
        self._load_specs.pop(request.request_id, None)
        self._no_retry.discard(request.request_id)

    def get_stats(self) -> KVConnectorStats:
        return KVConnectorStats(self._stats.queries, self._stats.hits)

    # ---- worker side: OffloadingWorker ---------------------------------------------------------

    def _get_worker(self) -> OffloadingWorker:
        if self._worker is None:
            from vlite.kv_connector.offloading_worker import OffloadingWorker

            assert self.role == KVConnectorRole.WORKER and len(self.stores) == 1
            self._worker = OffloadingWorker(self.stores[0])
        return self._worker

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        self._get_worker().register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if metadata.loads:
            self._get_worker().start_load(metadata.loads)

    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        if metadata.saves:
            self._get_worker().save(metadata.saves)

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        return self._get_worker().get_finished(idle) if self._worker is not None else KVConnectorOutput()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

"""The scheduler's part for a KV connector: requests whose prefix loads from outside the engine.

    waiting --(store hit: blocks allocated, load asked)--> WAITING_FOR_REMOTE_KVS, in skipped_waiting
        ... other requests are scheduled meanwhile; the worker loads in the background ...
    worker reports the load (k of n blocks) --> the k loaded blocks are registered in the prefix cache, the
        request's blocks released, status WAITING; in the same pass it is admitted as usual and finds them
        as local prefix-cache hits (k < n: the rest is recomputed, and the store is not asked again).

A request that finishes (abort) while its load runs keeps its blocks until the worker reports the load
done: the worker may still be writing into them. The scheduler mixes this in (methods of `Scheduler`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from vlite.kv_connector.base import KVConnectorOutput
from vlite.request import Request, RequestStatus

if TYPE_CHECKING:
    from vlite.core.kv_cache_utils import KVCacheBlock
    from vlite.core.sched.scheduler import Scheduler


class RemoteKVScheduling:
    """State (set up by `_init_remote_kv`) and steps of asynchronous KV loads."""

    def _init_remote_kv(self) -> None:
        # req_id -> (local prefix tokens, blocks asked) from the allocation until the request is promoted.
        self._kv_loading: dict[str, tuple[int, int]] = {}
        self._kv_done: dict[str, int] = {}  # req_id -> blocks loaded, reported by the worker, not yet promoted
        self._kv_free_after_load: dict[str, Request] = {}  # finished while loading: blocks freed once loaded
        self._kv_promoted: set[str] = set()  # loaded; their next admission skips the connector
        self._kv_discarded: set[str] = set()  # loading when a step failed: nothing of their blocks is kept

    def _lookup_remote_kv(self: Scheduler, request: Request, num_local_tokens: int) -> int:
        """Tokens past the local hit the connector can load (0: none, or the request was loaded already)."""
        if self.kv_connector is None or request.request_id in self._kv_promoted:
            return 0
        num_external, _ = self.kv_connector.get_num_new_matched_tokens(request, num_local_tokens)
        return num_external

    def _start_remote_load(self: Scheduler, request: Request, computed_blocks: list[KVCacheBlock],
                           num_local_tokens: int, num_external_tokens: int) -> None:
        """Allocate the blocks of the local hit and of the tokens to load, and ask the load; the request
        then waits in WAITING_FOR_REMOTE_KVS. Nothing happens if the blocks do not fit (it retries later)."""
        assert self.kv_connector is not None
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_external_tokens, num_local_tokens, computed_blocks,
                             delay_cache_blocks=True) is None:
            return
        self.kv_connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id), num_local_tokens,
                                                   num_external_tokens)
        self._kv_loading[request.request_id] = (num_local_tokens, num_external_tokens // kv.block_size)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def _note_admitted(self: Scheduler, request: Request, num_local_tokens: int) -> None:
        """A request admitted without a load: the connector's stats count its lookup."""
        if self.kv_connector is None:
            return
        if request.request_id in self._kv_promoted:
            self._kv_promoted.discard(request.request_id)  # counted when its load was asked
            return
        self.kv_connector.update_state_after_alloc(request, [], num_local_tokens, 0)

    def _try_promote_remote_kv(self: Scheduler, request: Request) -> bool:
        """True if the request's load is done: its loaded blocks are now prefix-cache blocks, and it is an
        ordinary waiting request again (admitted in the same pass); False: still loading."""
        req_id = request.request_id
        num_loaded = self._kv_done.pop(req_id, None)
        if num_loaded is None:
            return False
        num_local, num_asked = self._kv_loading.pop(req_id)
        kv = self.kv_cache_manager
        request.status = RequestStatus.WAITING
        if req_id in self._kv_discarded:  # admitted afresh (the store may be asked again)
            self._kv_discarded.discard(req_id)
            kv.free(request)
            return True
        kv.cache_blocks(request, num_local + num_loaded * kv.block_size)
        kv.free(request)
        if num_loaded < num_asked and self.kv_connector is not None:
            self.kv_connector.load_failed(request)
        self._kv_promoted.add(req_id)
        return True

    def _discard_remote_kv_prefixes(self: Scheduler) -> bool:
        """A step failed: the local-hit blocks of the requests loading now may be ones that step never filled.
        Their loads run on, but their blocks are dropped at promotion. True if any blocks are held for loads."""
        self._kv_discarded.update(self._kv_loading)
        return bool(self._kv_loading or self._kv_free_after_load)

    def _update_from_kv_output(self: Scheduler, output: Optional[KVConnectorOutput]) -> None:
        if output is None:
            return
        for req_id, num_loaded in output.finished_recving.items():
            finished = self._kv_free_after_load.pop(req_id, None)
            if finished is not None:
                self.kv_cache_manager.free(finished)
            elif req_id in self._kv_loading:
                self._kv_done[req_id] = num_loaded

    def _release_remote_kv(self: Scheduler, request: Request) -> bool:
        """The request finishes: forget its load. False if its blocks must outlive it (the load still runs)."""
        req_id = request.request_id
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        self._kv_promoted.discard(req_id)
        self._kv_discarded.discard(req_id)
        if self._kv_loading.pop(req_id, None) is None or self._kv_done.pop(req_id, None) is not None:
            return True
        self._kv_free_after_load[req_id] = request
        return False

"""OffloadingWorker: the worker half of the OffloadingConnector, moving KV blocks between the KV cache
tensors and the disk store on background threads.

Loads: a request's blocks are read (and checked) into one host buffer, then copied into their KV-cache
blocks, layer by layer; the engine keeps stepping meanwhile (the request waits in WAITING_FOR_REMOTE_KVS,
holding those blocks, so nothing else writes them). Its leading blocks that loaded are reported by
get_finished; the first missing or damaged one ends the run (the rest are recomputed).

Saves: after the step's forward the blocks to save are copied out of the KV cache at once (they may be
freed and reused by the next step), and written to files by the writer thread.

One block's bytes, the file payload: [num_layers, 2 (K, V), H_kv, block_size, head_dim] in the cache dtype.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from typing import Optional

import torch

from vlite.kv_connector.base import BlockTransfer, KVConnectorOutput
from vlite.kv_connector.disk_store import DiskKVStore

logger = logging.getLogger("vlite")

# Copies waiting for the writer past this many bytes: further saves are dropped (a slow disk must not
# grow the engine's memory without bound).
MAX_PENDING_SAVE_BYTES = 512 * 2**20
# An idle step (only requests waiting for their loads) waits this long for a load before returning.
_IDLE_WAIT_S = 0.01
_STOP = None


class OffloadingWorker:
    def __init__(self, store: DiskKVStore) -> None:
        self.store = store
        self.kv_caches: list[torch.Tensor] = []
        self._cond = threading.Condition()
        self._finished: dict[str, int] = {}  # req_id -> leading blocks loaded; guarded by _cond
        self._num_loading = 0  # jobs queued or running; guarded by _cond
        self._pending_save_bytes = 0  # guarded by _cond
        self._loads: queue.Queue = queue.Queue()
        self._saves: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        atexit.register(_shutdown_ref, weakref.ref(self))  # pending writes reach the disk at exit

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        cache = kv_caches[0]
        _, self.num_kv_heads, _, self.block_size, self.head_dim = cache.shape
        self.dtype = cache.dtype
        self.block_shape = (len(kv_caches), 2, self.num_kv_heads, self.block_size, self.head_dim)
        self.payload_bytes = cache.element_size() * len(kv_caches) * 2 * self.num_kv_heads * self.block_size \
            * self.head_dim
        if self._threads:
            return
        for target, name in ((self._load_loop, "vlite-kv-load"), (self._save_loop, "vlite-kv-save")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    # ---- loads ----------------------------------------------------------------------------------

    def start_load(self, loads: dict[str, list[BlockTransfer]]) -> None:
        with self._cond:
            self._num_loading += len(loads)
        for req_id, transfers in loads.items():
            self._loads.put((req_id, transfers))

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not _STOP:
            req_id, transfers = job
            try:
                num_loaded = self._load(transfers)
            except Exception:  # never the engine's end: the request recomputes its blocks
                logger.exception("vlite: loading KV blocks for %s failed", req_id)
                num_loaded = 0
            with self._cond:
                self._finished[req_id] = num_loaded
                self._num_loading -= 1
                self._cond.notify_all()

    def _load(self, transfers: list[BlockTransfer]) -> int:
        """Read the blocks into a host buffer, stopping at the first miss; copy those read into the cache."""
        host = torch.empty((len(transfers), self.payload_bytes), dtype=torch.uint8)
        rows = host.numpy()
        num_read = 0
        for i, (block_hash, _) in enumerate(transfers):
            if not self.store.load_into(block_hash, memoryview(rows[i])):
                break
            num_read += 1
        if num_read:
            blocks = host[:num_read].view(self.dtype).view(num_read, *self.block_shape)
            ids = torch.tensor([block_id for _, block_id in transfers[:num_read]], device=self.kv_caches[0].device)
            for layer, cache in enumerate(self.kv_caches):
                # [n, 2, H, bs, D] -> the cache's [2, H, n, bs, D] at the request's block ids
                cache[:, :, ids] = blocks[:, layer].permute(1, 2, 0, 3, 4).to(cache.device)
            if self.kv_caches[0].device.type == "cuda":
                torch.cuda.synchronize(self.kv_caches[0].device)
        return num_read

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        with self._cond:
            if idle and not self._finished and self._num_loading:
                self._cond.wait(_IDLE_WAIT_S)
            finished, self._finished = self._finished, {}
        return KVConnectorOutput(finished_recving=finished)

    # ---- saves ----------------------------------------------------------------------------------

    def save(self, saves: list[BlockTransfer]) -> None:
        """Copy the blocks out of the KV cache now; the writer thread stores them."""
        nbytes = len(saves) * self.payload_bytes
        with self._cond:
            if self._pending_save_bytes + nbytes > MAX_PENDING_SAVE_BYTES or not self.store.writable:
                return
            self._pending_save_bytes += nbytes
        host = torch.empty((len(saves), self.payload_bytes), dtype=torch.uint8)
        blocks = host.view(self.dtype).view(len(saves), *self.block_shape)
        ids = torch.tensor([block_id for _, block_id in saves], device=self.kv_caches[0].device)
        for layer, cache in enumerate(self.kv_caches):
            blocks[:, layer].copy_(cache.index_select(2, ids).permute(2, 0, 1, 3, 4))
        self._saves.put(([block_hash for block_hash, _ in saves], host))

    def _save_loop(self) -> None:
        try:  # Linux: a thread is a task with its own nice value; writes yield the CPU to the engine's steps
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        while (job := self._saves.get()) is not _STOP:
            hashes, host = job
            rows = host.numpy()
            try:
                for i, block_hash in enumerate(hashes):
                    self.store.save(block_hash, memoryview(rows[i]))
            except Exception:
                logger.exception("vlite: saving KV blocks failed")
            finally:
                with self._cond:
                    self._pending_save_bytes -= len(hashes) * self.payload_bytes
                self._saves.task_done()

    def flush(self) -> None:
        """Wait until every save handed over so far is written."""
        if self._threads:
            self._saves.join()

    def shutdown(self, timeout: Optional[float] = 60.0) -> None:
        """Write what is pending, then stop the threads (idempotent)."""
        threads, self._threads = self._threads, []
        if not threads:
            return
        self._loads.put(_STOP)
        self._saves.put(_STOP)
        for thread in threads:
            thread.join(timeout)


def _shutdown_ref(ref: weakref.ref) -> None:
    worker = ref()
    if worker is not None:
        worker.shutdown()

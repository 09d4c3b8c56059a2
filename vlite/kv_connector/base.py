"""KV connector interface (vLLM's KVConnectorBase_V1 split): KV blocks kept or fetched outside the engine.

One connector class, built twice: with role SCHEDULER in the engine core (pure Python, no torch) and with
role WORKER next to each model runner's KV cache. The two halves talk only through the step's messages:

    scheduler                                   worker (each rank)
    get_num_new_matched_tokens(request)         |
    update_state_after_alloc(request, blocks)   |
    build_connector_meta(scheduler_output) ---> start_load_kv(meta)   (background: files -> KV blocks)
                                                forward
                                                save_kv(meta)         (copy out now, write in background)
    update_connector_output(output) <---------- get_finished() -> KVConnectorOutput (loads done)

A request whose blocks load asynchronously waits in WAITING_FOR_REMOTE_KVS (skipped over by the scheduler,
holding its blocks) until the worker reports its load done; a block that failed to load is recomputed.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlite.core.kv_cache_manager import KVCacheManager
    from vlite.core.sched.output import SchedulerOutput
    from vlite.request import Request

# (block hash, block id): one KV block to move between the KV cache and the store.
BlockTransfer = tuple[bytes, int]


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"  # in the engine core: decides what to load and save
    WORKER = "worker"  # beside the KV cache tensors: moves the bytes


@dataclass
class KVConnectorMetadata:
    """What the scheduler asks the workers to do in one step (SchedulerOutput.kv_connector_metadata)."""

    # req_id -> the blocks to load for it, in prefix order; loads run in the background across steps.
    loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)
    # Full blocks whose K/V this step computes: copied out after the forward and stored.
    saves: list[BlockTransfer] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class KVConnectorOutput:
    """What a worker reports back (ModelRunnerOutput.kv_connector_output)."""

    # req_id -> how many of its blocks (leading ones, in the order asked) are now in the KV cache; fewer
    # than asked: the rest failed (missing, corrupt or unreadable file) and are recomputed.
    finished_recving: dict[str, int] = field(default_factory=dict)


@dataclass
class KVConnectorStats:
    """vLLM's external prefix-cache counters (cumulative, tokens)."""

    queries: int = 0  # prompt tokens of the requests admitted while the connector was asked
    hits: int = 0  # of those, tokens found outside the engine (and loaded)


class KVOutputAggregator:
    """Tensor parallelism: each rank loads its own heads of a request's blocks and reports on its own. The load is
    done once every rank reported it, with the fewest blocks any rank loaded (vLLM's KVOutputAggregator)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._reports: dict[str, list[int]] = {}  # req_id -> the counts of the ranks that reported it so far

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        if all(output is None for output in outputs):
            return None
        done: dict[str, int] = {}
        for output in outputs:
            for req_id, num_loaded in (output.finished_recving.items() if output is not None else ()):
                counts = self._reports.setdefault(req_id, [])
                counts.append(num_loaded)
                if len(counts) == self.world_size:
                    done[req_id] = min(self._reports.pop(req_id))
        return KVConnectorOutput(finished_recving=done)


class KVConnectorBase(ABC):
    """The two halves of a connector; each instance serves the methods of its `role`."""

    def __init__(self, role: KVConnectorRole) -> None:
        self.role = role

    # ---- scheduler side ----------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past the `num_computed_tokens` found locally that the connector can supply, whether
        they load asynchronously). Never all of the prompt: its last token is always computed."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        """Blocks are allocated for the request's local hits plus `num_external_tokens`: remember which to
        load into. Called at every admission (also with 0 external tokens: the stats count it)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                             kv_cache_manager: KVCacheManager) -> KVConnectorMetadata:
        """The step's loads (started since the last step) and saves (full blocks the step computes)."""

    @abstractmethod
    def request_finished(self, request: Request) -> None:
        """Forget the request (finished, aborted, or its load is over)."""

    @abstractmethod
    def get_stats(self) -> KVConnectorStats:
        """Cumulative external prefix-cache counters."""

    # ---- worker side -------------------------------------------------------------------------

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The runner's KV cache tensors, one per layer ([2, H_kv, num_blocks, block_size, D])."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin the step's loads (before the forward; they finish in the background)."""

    @abstractmethod
    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        """After the forward: copy the step's blocks to save out of the KV cache (written in the background)."""

    @abstractmethod
    def get_finished(self, idle: bool) -> KVConnectorOutput:
        """Loads finished since the last call. `idle`: the step computed nothing (wait a little for a load
        rather than let the engine spin)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Finish pending writes and stop the background threads."""

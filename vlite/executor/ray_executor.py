"""The `ray` executor: one Ray actor per tensor-parallel rank, placed by a placement group (one
bundle of {"CPU": 1} per rank), on any node of a Ray cluster.

Ray places the processes; the ranks talk over torch.distributed (gloo, rendezvous at rank 0's node
address), as with the `mp` executor. Each step's message is pickled once and put in Ray's object
store once; every actor gets the same reference. Rank 0's reply carries the sampled tokens.

Cluster: an existing one where RAY_ADDRESS names it (`ray start --head` on one node, `ray start
--address=HEAD:6379` on the others, then `RAY_ADDRESS=HEAD:6379 vlite serve ...`), else a local one
started here. vlite must be importable by Python on every node. The problems Ray users meet most
(a placement group that never becomes ready, a node address that does not match) end in an error
that names them instead of a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
from typing import TYPE_CHECKING, Any, Optional

from vlite.executor.abstract import ExecutorDeadError, Replies, WorkerGroupExecutor

if TYPE_CHECKING:
    from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from vlite.config import LoadedEngineConfig
    from vlite.structured_output.manager import GrammarOutput

logger = logging.getLogger("vlite")

_PG_READY_TIMEOUT_S = float(os.environ.get("VLITE_RAY_PG_TIMEOUT_S", "120"))
_START_TIMEOUT_S = 600.0
_PING_EVERY_S = 0.5
_PING_TIMEOUT_S = 10.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend 'ray' needs Ray: pip install 'vlite[ray]'") from None
    return ray


class RayWorkerWrapper:
    """The actor: a vlite.worker.worker.Worker built on demand, driven by pickled messages."""

    def __init__(self) -> None:
        self.worker = None

    def node_address(self) -> tuple[str, int, str]:
        """This actor's node IP, a free TCP port there (rank 0's: the rendezvous), and its node id."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, ray.get_runtime_context().get_node_id()

    def start(self, rank: int, world_size: int, init_method: str, loaded: LoadedEngineConfig) -> dict[str, Any]:
        from vlite.worker.worker import Worker

        self.worker = Worker(rank, world_size, init_method, loaded)
        return self.worker.info()

    def call(self, data: bytes) -> Optional[tuple[str, Any]]:
        method, arg = pickle.loads(data)
        return self.worker.handle(method, arg)

    def ping(self) -> bool:
        """Liveness, answered in its own concurrency group: also while a step runs."""
        return True


class RayExecutor(WorkerGroupExecutor):
    def __init__(self, loaded: LoadedEngineConfig) -> None:
        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world = loaded.config.parallel_config.tensor_parallel_size
        self._dead: Optional[str] = None
        self._closing = False
        self.actors: list[Any] = []
        self.placement_group = None
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            logger.info("vlite: %s", f"joining the Ray cluster at {address}" if address else "starting a local Ray")
            ray.init(address=address, log_to_driver=False)
        bundles = [{"CPU": 1.0} for _ in range(world)]
        self.placement_group = pg = placement_group(bundles, strategy=os.environ.get("VLITE_RAY_PG_STRATEGY", "PACK"))
        try:
            ray.get(pg.ready(), timeout=_PG_READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            available = ray.available_resources()
            self.shutdown()
            raise RuntimeError(f"Ray placement group of {world} bundles {bundles[0]} not ready after "
                               f"{_PG_READY_TIMEOUT_S:.0f}s: the cluster has {available.get('CPU', 0)} free CPUs "
                               f"over {len(ray.nodes())} node(s); add nodes or lower tensor_parallel_size") from None
        # calls in order, one at a time; pings on a thread of their own (the monitor's, between steps too)
        actor_class = ray.remote(num_cpus=1, concurrency_groups={"health": 1})(RayWorkerWrapper)
        self.actors = [actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank)).remote() for rank in range(world)]
        try:
            addresses = ray.get([a.node_address.remote() for a in self.actors], timeout=_START_TIMEOUT_S)
            self.node_ids = [node for _, _, node in addresses]
            ip, port, _ = addresses[0]
            worker_loaded = dataclasses.replace(loaded, weights={})
            self.worker_info = self._gather([a.start.remote(r, world, f"tcp://{ip}:{port}", worker_loaded)
                                             for r, a in enumerate(self.actors)], timeout=_START_TIMEOUT_S)
        except Exception as e:
            self.shutdown()
            if isinstance(e, ExecutorDeadError):
                raise
            raise RuntimeError(f"Ray workers failed to start: {e}") from e
        logger.info("vlite: %d Ray worker(s) ready on node(s) %s", world, self.node_ids)
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch_workers, name="vlite-ray-monitor", daemon=True)
        self._monitor.start()

    def _watch_workers(self) -> None:
        """Between steps too: an actor (or its node) that dies marks the executor dead within ~a second."""
        ray = self.ray
        while not self._stop.wait(_PING_EVERY_S):
            # never after shutdown: a Ray call then would start a new Ray (ray.init on first use)
            if self._closing or self._dead is not None or not ray.is_initialized():
                return
            refs = {a.ping.options(concurrency_group="health").remote(): r for r, a in enumerate(self.actors)}
            try:
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_PING_TIMEOUT_S)
                for ref in ready:
                    ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if not self._closing and self._dead is None:
                    self._dead = f"Ray worker died: {e}"
                    logger.error("vlite: %s", self._dead)
            except Exception:  # Ray shutting down under us
                return

    # ---- the step ----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._send("execute_model", scheduler_output)

    def sample_tokens(self, grammar_output: Optional[GrammarOutput] = None) -> ModelRunnerOutput:
        return self._step_output(self._gather(self._send("sample_tokens", grammar_output)))

    def reset(self) -> None:
        self._gather(self._send("reset"))

    def worker_stats(self) -> list[dict[str, Any]]:
        return self._gather(self._send("stats"))

    def _send(self, method: str, arg: Any = None) -> list[Any]:
        """One pickle, one object in the store, the same reference to every actor."""
        self.check_health()
        ref = self.ray.put(pickle.dumps((method, arg), protocol=pickle.HIGHEST_PROTOCOL))
        return [a.call.remote(ref) for a in self.actors]

    def _gather(self, refs: list[Any], timeout: Optional[float] = None) -> list[Any]:
        """Every actor's reply as it comes: a dead actor, or ranks that disagree on failing, end the executor."""
        return self._settle(self._replies(refs, timeout))

    def _call_all(self, method: str, arg: Any = None) -> Replies:
        return self._replies(self._send(method, arg))

    def _replies(self, refs: list[Any], timeout: Optional[float] = None) -> Replies:
        """Every actor's reply as it comes (a dead actor ends the executor at once), not yet settled."""
        ray = self.ray
        index = {ref: r for r, ref in enumerate(refs)}
        replies = Replies(len(refs), timeout)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=replies.time_left())
            if not ready:
                break
            rank = index[ready[0]]
            try:
                reply = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                self._fail(f"Ray worker rank {rank} died: {e}")
            except ray.exceptions.RayTaskError as e:
                reply = ("error", str(e))
            replies.add(rank, reply if isinstance(reply, tuple) else ("ok", reply))
        return replies

    # ---- lifecycle ----------------------------------------------------------------------------

    def _kill_workers(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            self._stop.set()
            monitor.join(2.0)  # out of its Ray calls before the caller may shut Ray down
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:
                pass
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass

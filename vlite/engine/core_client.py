"""Clients of the engine core: in-process (for LLM/LLMEngine) or a separate process (for AsyncLLM).

    API process                                  engine-core process
    AsyncMPClient --PUSH(ADD/ABORT/UTILITY)-->  EngineCoreProc.run_busy_loop
                  <--PULL(EngineCoreOutputs)---
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Any, Optional

import zmq
import zmq.asyncio

from vlite.config import ParallelConfig
from vlite.core.sched.stats import SchedulerStats, sum_scheduler_stats
from vlite.engine.arg_utils import EngineArgs
from vlite.engine.core_messages import (EngineCoreOutputs, EngineCoreRequestType, EngineReady, UtilityCall,
                                        decode_outputs, encode)
from vlite.engine.core_proc import run_engine_core
from vlite.engine.input_processor import EngineCoreRequest
from vlite.executor.start_method import PROCESS_PREFIX, UNGUARDED_MAIN_EXIT, unguarded_main_message

logger = logging.getLogger("vlite")

# The engine-core process is always spawned: ZeroMQ's threads run here by then (and a server's).
_SPAWNED_BECAUSE = "this process runs ZeroMQ's threads when it starts the engine core"


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can complete."""


class AsyncMPClient:
    """Runs EngineCoreProc in a child process and talks to it over ZeroMQ IPC sockets."""

    def __init__(self, engine_args: EngineArgs) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="vlite-")
        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"
        self.ctx = zmq.asyncio.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.bind(input_addr)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(output_addr)
        mp = multiprocessing.get_context("spawn")
        # A daemonic process may not start children: with worker processes the engine core is not one
        # (shutdown() still stops it, and its workers die with it).
        workers = ParallelConfig(engine_args.tensor_parallel_size, engine_args.distributed_executor_backend).backend
        self.proc = mp.Process(target=run_engine_core, name=f"{PROCESS_PREFIX}engine-core", daemon=workers == "uni",
                               args=(engine_args, input_addr, output_addr, logging.getLogger("vlite").level
                                     or logging.WARNING))
        self.proc.start()
        self._utility_ids = itertools.count()
        self._pending_utility: dict[int, asyncio.Future] = {}
        self.ready: Optional[EngineReady] = None
        self._closed = False
        # The engine core reported a fatal error and is exiting: send it nothing more (a message to a
        # process that no longer reads its socket would wait forever).
        self._failed = False

    @property
    def engine_pid(self) -> Optional[int]:
        return self.proc.pid

    def is_alive(self) -> bool:
        return not self._closed and not self._failed and self.proc.is_alive()

    async def wait_ready(self, timeout: float = 600.0) -> EngineReady:
        """Wait for the engine core's READY message (or its load error)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if await self.output_socket.poll(200):
                msg = decode_outputs(await self.output_socket.recv())
                if msg.engine_error:
                    raise RuntimeError(msg.engine_error)
                if msg.ready is not None:
                    self.ready = msg.ready
                    return msg.ready
            elif not self.proc.is_alive():
                if self.proc.exitcode == UNGUARDED_MAIN_EXIT:  # it re-ran the script up to its AsyncLLM
                    raise EngineDeadError(unguarded_main_message("AsyncLLM", _SPAWNED_BECAUSE))
                raise EngineDeadError(f"engine core exited during start-up (exit code {self.proc.exitcode})")
        raise TimeoutError("engine core did not become ready in time")

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, encode(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive():
            await self._send(EngineCoreRequestType.ABORT, encode(request_ids))

    async def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._utility_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending_utility[call_id] = future
        await self._send(EngineCoreRequestType.UTILITY, encode(UtilityCall(call_id, method, list(args))))
        return await future

    async def _send(self, kind: EngineCoreRequestType, payload: bytes) -> None:
        if not self.is_alive():
            raise EngineDeadError("the engine core is not running")
        await self.input_socket.send_multipart((kind.value, payload), copy=False)

    async def get_output(self, poll_ms: int = 500) -> Optional[EngineCoreOutputs]:
        """The next message from the engine core; None after `poll_ms` without one."""
        if not await self.output_socket.poll(poll_ms):
            return None
        msg = decode_outputs(await self.output_socket.recv())
        if msg.engine_error and self.ready is not None:
            self._failed = True
        if msg.utility_call_id is not None:
            future = self._pending_utility.pop(msg.utility_call_id, None)
            if future is not None and not future.done():
                if msg.utility_error is not None:  # the caller's error (ValueError) or the engine's
                    future.set_exception((ValueError if msg.utility_bad_request else RuntimeError)(msg.utility_error))
                else:
                    future.set_result(msg.utility_result)
        return msg

    def fail_pending_utility(self, error: BaseException) -> None:
        for future in self._pending_utility.values():
            if not future.done():
                future.set_exception(error)
        self._pending_utility.clear()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the engine core to stop, then make sure it has: no orphan process is left."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.proc.is_alive():
                self.input_socket.send_multipart((EngineCoreRequestType.SHUTDOWN.value, b""))
        except zmq.ZMQError:
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(1.0)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "proc", None) is not None \
                and os.getpid() != getattr(self.proc, "pid", None):
            try:
                self.shutdown(timeout=1.0)
            except Exception:
                pass


class DPAsyncMPClient:
    """`data_parallel_size` engine-core processes behind one API process (each an AsyncMPClient).

    Each request goes to the live core with the fewest unfinished requests (waiting + running, as
    counted here from what was sent and what came back: no lag behind the cores' stats). The
    cores' scheduler stats are summed (KV usage averaged) into every message, so /metrics shows the
    whole server. A core that dies fails its own requests only; the others keep serving.
    """

    _LIVENESS_EVERY_S = 0.1

    def __init__(self, engine_args: EngineArgs) -> None:
        self.clients = [AsyncMPClient(engine_args) for _ in range(engine_args.data_parallel_size)]
        self.proc = self.clients[0].proc  # the first core's process stands for the engine in messages
        self._alive = [True] * len(self.clients)
        self._owner: dict[str, int] = {}  # request id -> its core
        self._load = [0] * len(self.clients)  # unfinished requests per core
        self._stats: list[Optional[SchedulerStats]] = [None] * len(self.clients)
        self._dead_core_outputs: list[EngineCoreOutputs] = []  # requests of a core that died, to report
        self._next_poll = 0
        self._next_route = 0
        self._last_liveness = 0.0
        self.ready: Optional[EngineReady] = None

    @property
    def engine_pid(self) -> Optional[int]:
        return self.clients[0].engine_pid

    @property
    def engine_pids(self) -> list[Optional[int]]:
        return [c.engine_pid for c in self.clients]

    def is_alive(self) -> bool:
        return any(self._alive[i] and c.is_alive() for i, c in enumerate(self.clients))

    async def wait_ready(self, timeout: float = 600.0) -> EngineReady:
        readies = await asyncio.gather(*(c.wait_ready(timeout) for c in self.clients))
        self.ready = readies[0]
        return readies[0]

    async def add_request(self, request: EngineCoreRequest) -> None:
        live = [i for i, ok in enumerate(self._alive) if ok]
        if not live:
            raise EngineDeadError("no engine core is running")
        n = len(self.clients)
        # fewest unfinished requests; ties in turn, so a lone client's requests alternate between cores
        core = min(live, key=lambda i: (self._load[i], (i - self._next_route) % n))
        self._next_route = (core + 1) % n
        self._owner[request.request_id] = core
        self._load[core] += 1
        await self.clients[core].add_request(request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            core = self._finish(rid)
            if core is not None:
                by_core.setdefault(core, []).append(rid)
        for core, ids in by_core.items():
            if self._alive[core]:
                await self.clients[core].abort_requests(ids)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Every live core's answer, combined: all() of booleans, the stats summed (sum_scheduler_stats), the
        union of lists (list_loras)."""
        results = await asyncio.gather(*(c.call_utility(method, *args) for i, c in enumerate(self.clients)
                                         if self._alive[i]))
        if method == "get_stats" and results:
            import msgspec
            from dataclasses import asdict

            return asdict(sum_scheduler_stats([msgspec.convert(r, SchedulerStats) for r in results]))
        if results and all(isinstance(r, list) for r in results):
            return sorted({x for r in results for x in r})
        if all(isinstance(r, bool) for r in results):
            return all(results)
        return results[0] if results else None

    async def get_output(self, poll_ms: int = 500) -> Optional[EngineCoreOutputs]:
        self._check_liveness()
        if self._dead_core_outputs:
            return self._dead_core_outputs.pop(0)
        live = [i for i, ok in enumerate(self._alive) if ok]
        if not live:
            return None
        poller = zmq.asyncio.Poller()
        for i in live:
            poller.register(self.clients[i].output_socket, zmq.POLLIN)
        ready = dict(await poller.poll(poll_ms))
        n = len(self.clients)
        for k in range(n):  # round robin: a busy core does not starve the others
            i = (self._next_poll + k) % n
            if self._alive[i] and self.clients[i].output_socket in ready:
                self._next_poll = i + 1
                msg = await self.clients[i].get_output(0)
                return None if msg is None else self._account(i, msg)
        self._check_liveness(force=True)
        return self._dead_core_outputs.pop(0) if self._dead_core_outputs else None

    def _account(self, core: int, msg: EngineCoreOutputs) -> EngineCoreOutputs:
        """Count finished requests off their core, sum the stats, turn one core's fatal error into
        failures of its own requests."""
        for out in msg.outputs:
            if out.finish_reason is not None:
                self._finish(out.request_id)
        for rid in msg.failed_requests:
            self._finish(rid)
        if msg.engine_error:
            msg.failed_requests.update(self._core_died(core, f"engine core {core} failed: {msg.engine_error}"))
            if self.is_alive():
                msg.engine_error = None  # the other cores serve on
        if msg.stats is not None:
            self._stats[core] = msg.stats
        msg.stats = self._summed_stats()
        return msg

    def _finish(self, request_id: str) -> Optional[int]:
        core = self._owner.pop(request_id, None)
        if core is not None:
            self._load[core] -= 1
        return core

    def _core_died(self, core: int, error: str) -> dict[str, str]:
        """Mark `core` dead; its unfinished requests, each with `error`."""
        self._alive[core] = False
        logger.error("vlite: %s; %d core(s) still serving", error, sum(self._alive))
        last = self._stats[core]
        if last is not None:  # nothing runs there any more; its cumulative counters stay counted
            self._stats[core] = SchedulerStats(0, 0, 0.0, last.num_preemptions, last.prefix_cache_queries,
                                               last.prefix_cache_hits, spec_decoding=last.spec_decoding,
                                               max_lora=last.max_lora)
        ids = [rid for rid, c in self._owner.items() if c == core]
        for rid in ids:
            self._finish(rid)
        return {rid: error for rid in ids}

    def _check_liveness(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_liveness < self._LIVENESS_EVERY_S:
            return
        self._last_liveness = now
        for i, c in enumerate(self.clients):
            if self._alive[i] and not c.proc.is_alive():
                failed = self._core_died(i, f"engine core {i} died (exit code {c.proc.exitcode})")
                self._dead_core_outputs.append(EngineCoreOutputs(failed_requests=failed, stats=self._summed_stats()))

    def _summed_stats(self) -> Optional[SchedulerStats]:
        known = [s for s in self._stats if s is not None]
        return sum_scheduler_stats(known) if known else None

    def fail_pending_utility(self, error: BaseException) -> None:
        for c in self.clients:
            c.fail_pending_utility(error)

    def shutdown(self, timeout: float = 5.0) -> None:
        for c in self.clients:
            c.shutdown(timeout)

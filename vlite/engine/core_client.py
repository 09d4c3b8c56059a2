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
from typing import Any, Optional

import zmq
import zmq.asyncio

from vlite.config import ParallelConfig
from vlite.engine.arg_utils import EngineArgs
from vlite.engine.core_messages import (EngineCoreOutputs, EngineCoreRequestType, EngineReady, UtilityCall,
                                        decode_outputs, encode)
from vlite.engine.core_proc import run_engine_core
from vlite.engine.input_processor import EngineCoreRequest

logger = logging.getLogger("vlite")


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
        self.proc = mp.Process(target=run_engine_core, name="vlite-engine-core", daemon=workers == "uni",
                               args=(engine_args, input_addr, output_addr, logging.getLogger("vlite").level
                                     or logging.WARNING))
        self.proc.start()
        self._utility_ids = itertools.count()
        self._pending_utility: dict[int, asyncio.Future] = {}
        self.ready: Optional[EngineReady] = None
        self._closed = False

    @property
    def engine_pid(self) -> Optional[int]:
        return self.proc.pid

    def is_alive(self) -> bool:
        return not self._closed and self.proc.is_alive()

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
        if msg.utility_call_id is not None:
            future = self._pending_utility.pop(msg.utility_call_id, None)
            if future is not None and not future.done():
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

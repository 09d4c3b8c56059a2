"""The `mp` executor: one worker process per tensor-parallel rank on this machine (vlite.worker.worker).

Each step's SchedulerOutput is pickled once and the same bytes are written to every worker's pipe
(no per-worker pickling); every rank runs the step, rank 0 returns the sampled tokens, the others
an acknowledgement. Failure, never a hang:

- a worker that exits (killed, crashed) is seen at once, while a step waits (its process sentinel
  is waited on beside the pipes) or between steps (a monitor thread): ExecutorDeadError, the other
  workers are stopped;
- a worker that raises while the others do not (they may be blocked in a collective): after a
  short grace the executor gives up on the group (ExecutorDeadError); if every rank raised alike
  (e.g. on a bad input before the forward), the step fails as it would in one process;
- the collectives themselves time out (vlite.distributed.parallel_state.init_tp_group).

The workers are forked where that is safe, else spawned (vlite.executor.start_method); a spawned
worker that finds the user's script starting the engine again at module level (no `__main__` guard)
exits at once, and the executor raises the one line that says so.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import pickle
import socket
import threading
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, Callable, Optional

from vlite.executor import start_method
from vlite.executor.abstract import ExecutorDeadError, Replies, WorkerGroupExecutor
from vlite.worker.worker import run_worker

if TYPE_CHECKING:
    from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from vlite.config import LoadedEngineConfig
    from vlite.structured_output.manager import GrammarOutput

logger = logging.getLogger("vlite")

_START_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _UnguardedMain(Exception):
    """A spawned worker found the user's script starting the engine at module level (no guard)."""


class MultiprocExecutor(WorkerGroupExecutor):
    def __init__(self, loaded: LoadedEngineConfig, while_loading: Optional[Callable[[], None]] = None) -> None:
        """`while_loading`: run in this process once the workers are started, while they load (a thread
        it starts cannot be inherited by a forked worker)."""
        self.world_size = loaded.config.parallel_config.tensor_parallel_size
        self._dead: Optional[str] = None
        self._closing = False
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns = []
        what = f"LLM(tensor_parallel_size={self.world_size})"
        start_method.exit_if_bootstrapping(what)
        self.start_method, why_spawn = start_method.worker_start_method()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context(self.start_method)
        worker_loaded = dataclasses.replace(loaded, weights={})
        level = logging.getLogger("vlite").level or logging.WARNING
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            # A forked rank closes its copies of this process's pipe ends, its own and the earlier ranks'
            # (a spawned one inherits none): it must see EOF when this process is gone.
            inherited = [c.fileno() for c in (*self.conns, parent_conn)] if self.start_method == "fork" else []
            proc = ctx.Process(target=run_worker, name=f"{start_method.PROCESS_PREFIX}worker-{rank}", daemon=True,
                               args=(rank, self.world_size, init_method, worker_loaded, child_conn, os.getpid(),
                                     level, inherited))
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        try:
            if while_loading is not None:
                while_loading()
            self.worker_info: list[dict[str, Any]] = self._collect(timeout=_START_TIMEOUT_S)
        except _UnguardedMain:
            # The ranks re-ran the script and stopped at its LLM(...): say so once, nothing else.
            self.shutdown(graceful=False)
            raise ExecutorDeadError(start_method.unguarded_main_message(what, why_spawn)) from None
        except Exception:
            self.shutdown()
            raise
        logger.info("vlite: %d worker(s) ready (tensor parallel, %s): %s", self.world_size, self.start_method,
                    ", ".join(f"rank {i['rank']} pid {i['pid']} weights {i['weight_bytes'] / 2**20:.1f} MiB"
                              for i in self.worker_info))
        # Only now (after any fork): the exit handler and the monitor thread belong to this process alone.
        atexit.register(self.shutdown)  # before multiprocessing's own exit handler kills the workers
        self._monitor = threading.Thread(target=self._watch_workers, name="vlite-worker-monitor", daemon=True)
        self._monitor.start()

    # ---- the step ----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._broadcast("execute_model", scheduler_output)

    def sample_tokens(self, grammar_output: Optional[GrammarOutput] = None) -> ModelRunnerOutput:
        self._broadcast("sample_tokens", grammar_output)
        return self._step_output(self._collect())

    def reset(self) -> None:
        self._broadcast("reset")
        self._collect()

    def worker_stats(self) -> list[dict[str, Any]]:
        """Each rank's resident weight bytes and process RSS (measurements, tests)."""
        self._broadcast("stats")
        return self._collect()

    # ---- messages -----------------------------------------------------------------------------

    def _broadcast(self, method: str, arg: Any = None) -> None:
        """One pickle, the same bytes to every rank."""
        self.check_health()
        data = pickle.dumps((method, arg), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError as e:
                self._fail(f"cannot reach worker rank {rank}: {e}")

    def _collect(self, timeout: Optional[float] = None) -> list[Any]:
        """Every rank's reply; a dead worker, or ranks that disagree on failing, end the executor."""
        return self._settle(self._replies(timeout))

    def _call_all(self, method: str, arg: Any = None) -> Replies:
        self._broadcast(method, arg)
        return self._replies()

    def _replies(self, timeout: Optional[float] = None) -> Replies:
        """Every rank's reply as it comes (a dead worker ends the executor at once), not yet settled."""
        replies = Replies(self.world_size, timeout)
        by_conn = {id(c): r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while replies.pending:
            ready = wait([self.conns[r] for r in replies.pending] + list(by_sentinel), replies.time_left())
            if not ready:
                break
            # pipes first: a worker that reports an error and exits is reported by its error
            for obj in sorted(ready, key=lambda o: isinstance(o, int)):
                if isinstance(obj, int):
                    rank = by_sentinel[obj]
                    if rank in replies.pending and self.conns[rank].poll():
                        continue  # its last words are read on the next turn
                    self._gone(rank, replies.first_error())
                rank = by_conn[id(obj)]
                try:
                    replies.add(rank, pickle.loads(obj.recv_bytes()))
                except (EOFError, OSError):
                    self._gone(rank)
        return replies

    def _gone(self, rank: int, first_error: str = "") -> None:
        message = first_error or self._exit_message(rank)
        if self.procs[rank].exitcode == start_method.UNGUARDED_MAIN_EXIT:
            raise _UnguardedMain(message)  # (start-up only) reported by __init__, once
        self._fail(message)

    def _exit_message(self, rank: int) -> str:
        proc = self.procs[rank]
        # Its sentinel fired: it is gone, only maybe not yet reaped. The monitor thread may be reaping it
        # at the same moment (then this thread's join sees no exit code until that one records it).
        deadline = time.monotonic() + 1.0
        proc.join(1.0)
        while proc.exitcode is None and time.monotonic() < deadline:
            proc.join(0.02)
        return f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"

    def _kill_workers(self) -> None:
        self.shutdown(graceful=False)

    def _watch_workers(self) -> None:
        """Between steps too: a worker that exits marks the executor dead at once."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        ready = wait(list(sentinels))
        if not self._closing and self._dead is None:
            self._dead = self._exit_message(sentinels[ready[0]])
            logger.error("vlite: %s", self._dead)

    # ---- lifecycle ----------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """Ask the workers to exit (`graceful`: give them up to 2 s), then kill any left."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        data = pickle.dumps(("shutdown", None))
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                pass
        deadline = time.monotonic() + (2.0 if graceful else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self.conns:
            conn.close()

    def __del__(self) -> None:
        if not getattr(self, "_closing", True):
            try:
                self.shutdown()
            except Exception:
                pass

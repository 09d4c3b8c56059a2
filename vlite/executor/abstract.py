"""Executor: what EngineCore drives a step through, whatever the processes behind it.

    uni  the ModelRunner in the engine-core process (vlite.executor.uniproc_executor)
    mp   one worker process per tensor-parallel rank on this machine (vlite.executor.multiproc_executor)
    ray  one Ray actor per rank, placed by a placement group on any node of a Ray cluster (ray_executor)

EngineCore calls execute_model(scheduler_output), then sample_tokens(grammar_output), once per step:
every rank runs the step; the tokens come from rank 0. LoRA adapters (add_lora, remove_lora, list_loras,
pin_lora) are loaded and dropped on every rank alike; the answer is rank 0's, and an adapter refused (a
bad folder: the user's error) is raised to the caller without harming the executor.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from vlite.config import LoadedEngineConfig
    from vlite.kv_connector.base import KVOutputAggregator
    from vlite.lora.request import LoRARequest
    from vlite.structured_output.manager import GrammarOutput


logger = logging.getLogger("vlite")

_ERROR_GRACE_S = 2.0  # after one rank's error, how long the others get to answer


class ExecutorDeadError(RuntimeError):
    """A worker is gone or out of step with the others: no request can complete on this executor."""


class Executor(ABC):
    @staticmethod
    def create(loaded: LoadedEngineConfig, while_loading: Optional[Callable[[], None]] = None) -> Executor:
        """The executor the parallel config names. `while_loading`: run in this process while the model
        loads (the mp executor: once its workers are started, so that they cannot inherit its thread)."""
        backend = loaded.config.parallel_config.backend
        if backend == "mp":
            from vlite.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor(loaded, while_loading)
        if while_loading is not None:
            while_loading()
        if backend == "uni":
            from vlite.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor(loaded)
        if backend == "ray":
            from vlite.executor.ray_executor import RayExecutor

            return RayExecutor(loaded)
        raise ValueError(f"distributed_executor_backend {backend!r} is not supported")

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the step's forward on every rank (the outputs wait for sample_tokens)."""

    @abstractmethod
    def sample_tokens(self, grammar_output: Optional[GrammarOutput] = None) -> ModelRunnerOutput:
        """The step's sampled tokens (rank 0's; the other ranks take the same ones)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the persistent batch on every rank after a step raised (see ModelRunner.reset)."""

    @abstractmethod
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (True if it was not loaded); a LoRAAdapterError / ValueError if it cannot be applied."""

    @abstractmethod
    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter (False if it was not loaded)."""

    @abstractmethod
    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded."""

    @abstractmethod
    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep an adapter loaded, never evicted for another."""

    def check_health(self) -> None:
        """Raise ExecutorDeadError if a worker is gone."""

    def shutdown(self) -> None:
        """Stop the workers; no process is left behind."""


class Replies:
    """One reply per rank, as they come. After a rank's error the others get a short grace: they may
    be blocked in a collective the failed rank never joined."""

    def __init__(self, world_size: int, timeout: Optional[float] = None) -> None:
        self.values: list[Any] = [None] * world_size
        self.errors: dict[int, str] = {}
        self.pending = set(range(world_size))
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def time_left(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def add(self, rank: int, reply: tuple[str, Any]) -> None:
        kind, value = reply
        self.pending.discard(rank)
        if kind != "error":
            self.values[rank] = value
            return
        self.errors[rank] = value
        if self.deadline is None or self.deadline - time.monotonic() > _ERROR_GRACE_S:
            self.deadline = time.monotonic() + _ERROR_GRACE_S

    def first_error(self) -> str:
        return f"rank {min(self.errors)} failed: {self.errors[min(self.errors)]}" if self.errors else ""


class WorkerGroupExecutor(Executor):
    """Ranks in other processes (mp, ray): what a missing, dead or lone failing rank means."""

    _dead: Optional[str] = None
    _kv_aggregator: Optional[KVOutputAggregator] = None  # with a KV connector under tensor parallelism

    @abstractmethod
    def _kill_workers(self) -> None:
        """Stop every rank now (some may be blocked in a collective: no waiting for them)."""

    def check_health(self) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)

    def _fail(self, message: str) -> None:
        if self._dead is None:
            self._dead = message
        logger.error("vlite: model workers failed: %s", message)
        self._kill_workers()
        raise ExecutorDeadError(message)

    @abstractmethod
    def _call_all(self, method: str, arg: Any = None) -> Replies:
        """Send one message to every rank; their replies, not yet settled."""

    def _step_output(self, values: list[Any]) -> ModelRunnerOutput:
        """Rank 0's output of sample_tokens, with the KV-connector reports of every rank merged (the others
        send only theirs: see Worker.handle)."""
        out = values[0]
        if len(values) > 1 and any(v is not None for v in values[1:]):
            if self._kv_aggregator is None:
                from vlite.kv_connector.base import KVOutputAggregator

                self._kv_aggregator = KVOutputAggregator(len(values))
            out.kv_connector_output = self._kv_aggregator.aggregate([out.kv_connector_output, *values[1:]])
        return out

    def _check_answered(self, replies: Replies) -> None:
        """A rank that did not answer is lost (maybe blocked in a collective): the executor ends."""
        if replies.pending:
            self._fail(f"worker rank(s) {sorted(replies.pending)} did not answer"
                       + (f" after {replies.first_error()}" if replies.errors else ""))

    def _settle(self, replies: Replies) -> list[Any]:
        """The replies once every rank answered: every rank failing alike fails the step (the group is
        whole: the engine core fails its requests and goes on); some failing alone end the executor."""
        self._check_answered(replies)
        if replies.errors:
            first = replies.errors[min(replies.errors)]
            if len(replies.errors) == len(replies.values):
                raise RuntimeError(first)
            self._fail(f"worker rank(s) {sorted(replies.errors)} failed alone: {first}")
        return replies.values

    # ---- LoRA adapters: every rank alike ---------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora_call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_call("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        return self._lora_call("list_loras")

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._lora_call("pin_lora", lora_int_id)

    def _lora_call(self, method: str, arg: Any = None) -> Any:
        """Rank 0's answer. A rank's error (each rank sends its exception, see Worker.handle) is raised to the
        caller: an adapter is the user's input, not a broken group. An add_lora that failed on some ranks
        only (e.g. a folder one node lacks) is undone on the others, so that every rank holds the same ones."""
        replies = self._call_all(method, arg)
        self._check_answered(replies)
        if not replies.errors:
            return replies.values[0]
        if method == "add_lora":
            loaded = [r for r, v in enumerate(replies.values) if r not in replies.errors and v]
            if loaded:
                self._settle(self._call_all("remove_lora", arg.lora_int_id))
        error = replies.errors[min(replies.errors)]
        raise error if isinstance(error, Exception) else ValueError(str(error))

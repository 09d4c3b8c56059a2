"""Executor: what EngineCore drives a step through, whatever the processes behind it.

    uni  the ModelRunner in the engine-core process (vlite.executor.uniproc_executor)
    mp   one worker process per tensor-parallel rank on this machine (vlite.executor.multiproc_executor)

EngineCore calls execute_model(scheduler_output), then sample_tokens(grammar_output), once per step:
every rank runs the step; the tokens come from rank 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from vlite.engine.arg_utils import LoadedEngineConfig
    from vlite.structured_output.manager import GrammarOutput


class ExecutorDeadError(RuntimeError):
    """A worker is gone or out of step with the others: no request can complete on this executor."""


class Executor(ABC):
    @staticmethod
    def create(loaded: LoadedEngineConfig) -> Executor:
        """The executor the parallel config names."""
        backend = loaded.config.parallel_config.backend
        if backend == "uni":
            from vlite.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor(loaded)
        if backend == "mp":
            from vlite.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor(loaded)
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

    def check_health(self) -> None:
        """Raise ExecutorDeadError if a worker is gone."""

    def shutdown(self) -> None:
        """Stop the workers; no process is left behind."""

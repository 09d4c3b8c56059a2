"""Executors: where and in how many processes the model runs (vLLM's executor layer)."""

from vlite.executor.abstract import Executor, ExecutorDeadError

__all__ = ["Executor", "ExecutorDeadError"]

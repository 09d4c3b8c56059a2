"""Pooling parameters with vLLM's names: what a pooling request (an embedding, a score, a class) asks for.

A pooling request runs its prompt and ends when the pooled output exists; it samples nothing. Its
parameters are checked against the model's pooler when the request is made (`verify`), before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

# What LLM.encode / the server routes ask a pooling model for (vLLM's PoolingTask names).
POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """`dimensions`: keep the first n dims of the embedding, renormalized (Matryoshka models only).
    `normalize`: L2-normalize the embedding (None: as the model's pipeline says).
    `activation`: apply the classifier's activation to its logits (None: yes).
    `truncate_prompt_tokens`: keep the last n prompt tokens (-1: as many as the model takes).
    `task`: set by the API that makes the request.
    `prompt_tokens_skipped`: set by the engine: the leading tokens (an instruction prompt the model's pipeline
    put before the text) that a pipeline with include_prompt False leaves out of the pooling."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    activation: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    task: Optional[str] = None
    prompt_tokens_skipped: int = 0

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens", "prompt_tokens_skipped"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.prompt_tokens_skipped < 0:
            raise ValueError(f"prompt_tokens_skipped must be at least 0, got {self.prompt_tokens_skipped}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                            or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

    def clone(self) -> PoolingParams:
        return replace(self)

    def verify(self, task: str, pooler_config: Any, hidden_size: int) -> PoolingParams:
        """These parameters for `task` on a model with `pooler_config` (vlite.pooling.config.PoolerConfig); a
        ValueError naming the field and its limit where they do not fit, before any work."""
        if self.task is not None and self.task != task:
            raise ValueError(f"task {self.task!r} does not match the request's {task!r}")
        if self.dimensions is not None and task != "embed":
            raise ValueError(f"dimensions applies to embeddings only, not to task {task!r}")
        pooler_config.check_dimensions(self.dimensions, hidden_size)
        return replace(self, task=task)

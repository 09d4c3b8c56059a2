"""vlite: a small, readable LLM inference engine on vLLM's V1 design, CPU first."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Exported names load on first use: the API server process never needs torch (the engine-core
# process runs the model), and importing it costs ~200 MB of memory and a second of start-up.
_EXPORTS = {
    "EngineArgs": "vlite.engine.arg_utils",
    "LLMEngine": "vlite.engine.llm_engine",
    "LLM": "vlite.entrypoints.llm",
    "CompletionOutput": "vlite.outputs",
    "Logprob": "vlite.outputs",
    "RequestOutput": "vlite.outputs",
    "PoolingRequestOutput": "vlite.outputs",
    "EmbeddingRequestOutput": "vlite.outputs",
    "ClassificationRequestOutput": "vlite.outputs",
    "ScoringRequestOutput": "vlite.outputs",
    "PoolingParams": "vlite.pooling_params",
    "RequestOutputKind": "vlite.sampling_params",
    "SamplingParams": "vlite.sampling_params",
    "StructuredOutputsParams": "vlite.sampling_params",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from vlite.engine.arg_utils import EngineArgs
    from vlite.engine.llm_engine import LLMEngine
    from vlite.entrypoints.llm import LLM
    from vlite.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, Logprob,
                               PoolingRequestOutput, RequestOutput, ScoringRequestOutput)
    from vlite.pooling_params import PoolingParams
    from vlite.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vlite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

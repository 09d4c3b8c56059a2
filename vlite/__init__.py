"""vlite: a small, readable LLM inference engine on vLLM's V1 design, CPU first."""

from vlite.engine.arg_utils import EngineArgs
from vlite.engine.llm_engine import LLMEngine
from vlite.entrypoints.llm import LLM
from vlite.outputs import CompletionOutput, Logprob, RequestOutput
from vlite.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]

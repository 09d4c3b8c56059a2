"""Reasoning parsers (vLLM's vllm.reasoning): split a thinking model's output into its reasoning and its
answer. Used by the server (`--reasoning-parser`), by LLM.chat (`LLM(..., reasoning_parser=...)`), by the
engine (structured outputs apply to the answer only), and importable for users' own post-processing."""

from vlite.reasoning.abs_reasoning_parsers import (CONTENT, PENDING, REASONING, ReasoningDelta, ReasoningParser,
                                                   ReasoningParserManager)
from vlite.reasoning.gptoss import GptOssReasoningParser
from vlite.reasoning.parsers import (DeepSeekR1ReasoningParser, GenericReasoningParser, Qwen3ReasoningParser,
                                     resolve_reasoning_parser)

__all__ = ["CONTENT", "PENDING", "REASONING", "DeepSeekR1ReasoningParser", "GenericReasoningParser",
           "GptOssReasoningParser", "Qwen3ReasoningParser", "ReasoningDelta", "ReasoningParser", "ReasoningParserManager",
           "resolve_reasoning_parser"]

"""The reasoning parsers by model family (`--reasoning-parser NAME`), and the generic one configured by its
tags (`--reasoning-config '{"reasoning_start_str": ..., "reasoning_end_str": ...}'`, vLLM's keys)."""

from __future__ import annotations

from typing import Any, Optional

from vlite.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distillations: the template ends the prompt with `<think>\\n`, so the output starts
    in the block; without any start tag the output is still reasoning up to `</think>` (vLLM's rule: R1
    always thinks, and older templates left the tag to the model)."""

    implicit_start = True


@ReasoningParserManager.register("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and QwQ, SmolLM3, Phi-4-reasoning: the same tags): the model opens the block itself, or the
    template does (the Thinking-2507 variants); with enable_thinking false the template writes an empty block
    and the output is all answer. An output that opens no block is all answer."""


@ReasoningParserManager.register("generic")
class GenericReasoningParser(ReasoningParser):
    """Any model whose thinking sits between two fixed strings: configured with `configured(start, end)`."""

    @classmethod
    def configured(cls, start_str: str, end_str: str, implicit_start: bool = False) -> type[ReasoningParser]:
        return type(f"{cls.__name__}[{start_str}...{end_str}]", (cls,),
                    {"start_str": start_str, "end_str": end_str, "implicit_start": implicit_start})


CONFIG_KEYS = ("reasoning_start_str", "reasoning_end_str", "implicit_start")


def resolve_reasoning_parser(name: str, config: Optional[dict[str, Any]] = None) -> type[ReasoningParser]:
    """The parser class that `name` and a reasoning config (vLLM's reasoning_start_str / reasoning_end_str,
    plus implicit_start) give: "generic" needs both strings; for a named family they override its tags."""
    cls = ReasoningParserManager.get_reasoning_parser(name)
    config = dict(config or {})
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"reasoning_config: unknown keys {unknown}; known: {list(CONFIG_KEYS)}")
    start, end = config.get("reasoning_start_str"), config.get("reasoning_end_str")
    for key, value in (("reasoning_start_str", start), ("reasoning_end_str", end)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"reasoning_config: {key} must be a non-empty string, got {value!r}")
    implicit = config.get("implicit_start", cls.implicit_start)
    if not isinstance(implicit, bool):
        raise ValueError(f"reasoning_config: implicit_start must be true or false, got {implicit!r}")
    if cls is GenericReasoningParser and (start is None or end is None):
        raise ValueError('reasoning_parser "generic" needs reasoning_config with reasoning_start_str and '
                         'reasoning_end_str, e.g. \'{"reasoning_start_str": "<think>", "reasoning_end_str": '
                         '"</think>"}\'')
    if start is None and end is None and implicit == cls.implicit_start:
        return cls
    return GenericReasoningParser.configured(start or cls.start_str, end or cls.end_str, implicit)

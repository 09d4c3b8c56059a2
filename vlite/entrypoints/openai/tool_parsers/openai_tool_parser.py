"""`--tool-call-parser openai` (vLLM's name): gpt-oss's tool calls, harmony messages on the commentary
channel addressed `to=functions.NAME`, their content the arguments (JSON, as `<|constrain|>json` says).
The arguments are returned as the model wrote them, streamed or not; the content is the `final` channel
(and a commentary preamble); the analysis channel is the reasoning parser's (`openai_gptoss`)."""

from __future__ import annotations

from typing import Any, Optional

from vlite.entrypoints.openai.tool_parsers.abstract_tool_parser import (DeltaMessage, ExtractedToolCalls,
                                                                       ToolParser, make_tool_call_id, tool_call)
from vlite.entrypoints.openai.tool_parsers.registry import ToolParserManager
from vlite.harmony.parser import HarmonyParser, parse_completion


def call_deltas(calls: list[tuple[int, Optional[str], str]]) -> list[dict[str, Any]]:
    """Harmony's tool-call pieces in OpenAI's streamed shape: a call's first delta names it (with its id),
    the later ones carry arguments text."""
    out: list[dict[str, Any]] = []
    for index, name, arguments in calls:
        if name is not None:
            out.append({"index": index, "id": make_tool_call_id(), "type": "function",
                        "function": {"name": name, "arguments": arguments}})
        elif arguments:
            out.append({"index": index, "function": {"arguments": arguments}})
    return out


@ToolParserManager.register("openai")
class OpenAIToolParser(ToolParser):
    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._parser = HarmonyParser()

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        parsed = parse_completion(model_output)
        return ExtractedToolCalls(bool(parsed.calls), [tool_call(n, a) for n, a in parsed.calls], parsed.content)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        d = self._parser.feed(delta_text)
        self.num_calls = self._parser.num_calls
        return DeltaMessage(content=d.content, tool_calls=call_deltas(d.calls))

    def finish_streaming(self) -> DeltaMessage:
        d = self._parser.finish()
        return DeltaMessage(content=d.content, tool_calls=call_deltas(d.calls))

"""--tool-call-parser openai: harmony's calls to functions.NAME, whole and streamed (the deltas in OpenAI's
shape add up to the whole parse)."""

from __future__ import annotations

import json

from tests.harmony.test_parser import ARITHMETIC, PREAMBLE, TOOL_CALL
from vlite.entrypoints.openai.tool_parsers import OpenAIToolParser, ToolParserManager

TWO_CALLS = TOOL_CALL + '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}'


def streamed_calls(pieces):
    calls: dict[int, dict] = {}
    for c in pieces:
        entry = calls.setdefault(c["index"], {"name": None, "arguments": "", "ids": []})
        if "id" in c:
            entry["ids"].append(c["id"])
            entry["name"] = c["function"]["name"]
        entry["arguments"] += c["function"].get("arguments", "")
    return calls


def test_registered_whole_and_streamed():
    assert ToolParserManager.get_tool_parser("openai") is OpenAIToolParser
    for text in (ARITHMETIC, TOOL_CALL, PREAMBLE, TWO_CALLS):
        whole = OpenAIToolParser().extract_tool_calls(text)
        p, content, pieces = OpenAIToolParser(), "", []
        for i in range(0, len(text), 4):
            d = p.extract_tool_calls_streaming(text[i:i + 4])
            content, pieces = content + d.content, pieces + d.tool_calls
        d = p.finish_streaming()
        content, pieces = content + d.content, pieces + d.tool_calls
        assert (content or None) == whole.content and p.num_calls == len(whole.tool_calls)
        calls = streamed_calls(pieces)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
        assert all(len(c["ids"]) == 1 and c["ids"][0].startswith("chatcmpl-tool-") for c in calls.values())
    whole = OpenAIToolParser().extract_tool_calls(TWO_CALLS)
    assert whole.tools_called and [json.loads(c["function"]["arguments"]) for c in whole.tool_calls] == \
        [{"location": "San Francisco"}, {}]

"""--tool-call-parser openai: harmony's calls to functions.NAME, whole and streamed (the deltas in OpenAI's
shape add up to the whole parse), and the serving helpers that build a harmony chat's message and stream
chunks (reasoning and tool calls together, as the server returns them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests.harmony.test_parser import ARITHMETIC, PREAMBLE, TOOL_CALL
from vlite.entrypoints.openai.serving_harmony import full_message, new_parser, stream_delta
from vlite.entrypoints.openai.tool_parsers import OpenAIToolParser, ToolParserManager

PROMPT = "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
TWO_CALLS = TOOL_CALL + '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}'


@dataclass
class Tools:  # what serving_chat's _Tools offers the helpers
    parallel: bool = True


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


def test_serving_message_and_chunks():
    message, called = full_message(PROMPT, TOOL_CALL, Tools(), include_reasoning=True)
    assert called and message["content"] is None
    assert message["reasoning"] == message["reasoning_content"] == "Need to use function get_weather."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"location":"San Francisco"}')]
    message, called = full_message(PROMPT, TWO_CALLS, Tools(parallel=False), include_reasoning=False)
    assert len(message["tool_calls"]) == 1 and "reasoning" not in message
    message, called = full_message(PROMPT, TOOL_CALL, None, include_reasoning=True)  # tool_choice "none"
    assert not called and message["content"] == "" and "tool_calls" not in message
    for text in (ARITHMETIC, TOOL_CALL, TWO_CALLS):
        parser, reasoning, content, pieces, called = new_parser(PROMPT), "", "", [], False
        step = 5
        for i in range(0, len(text), step):
            delta, called = stream_delta(parser, text[i:i + step], i + step >= len(text), Tools(), True)
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning", "")
            content += delta.get("content", "")
            pieces += delta.get("tool_calls", [])
        whole, whole_called = full_message(PROMPT, text, Tools(), True)
        assert (reasoning or None, content or None, called) == (whole["reasoning"], whole["content"] or None,
                                                                whole_called)
        assert [(c["name"], c["arguments"]) for c in streamed_calls(pieces).values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]

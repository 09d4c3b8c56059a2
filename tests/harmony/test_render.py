"""The harmony renderer against the format's published examples (openai/harmony docs/format.md): the
function-calling prompt byte for byte, the earlier turn's thinking dropped once it was answered, and the
TypeScript-like tool definitions; bad conversations are errors naming the message."""

from __future__ import annotations

import pytest

from vlite.harmony import render_chat
from vlite.harmony.typescript import schema_type

DATE = "2025-06-28"
FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "format": FORMAT}, "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "get_multiple_weathers", "description": "Gets the current weather in the provided list of locations.",
        "parameters": {"type": "object", "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
            "format": FORMAT}, "required": ["locations"]}}},
]
SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
          "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
          "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
          "Calls to these tools must go to the commentary channel: 'functions'.<|end|>")
DEVELOPER = """<|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|>"""
# format.md, "Handling tool calls": the whole prompt after the function's result came back.
PUBLISHED_TOOL_PROMPT = (
    SYSTEM + DEVELOPER + "<|start|>user<|message|>What is the weather like in SF?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
    '{"location":"San Francisco"}<|call|>'
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}'
    "<|end|><|start|>assistant")
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location":"San Francisco"}'}}
TOOL_TURN = [
    {"role": "system", "content": "Use a friendly tone."},
    {"role": "user", "content": "What is the weather like in SF?"},
    {"role": "assistant", "content": None, "reasoning": "Need to use function get_weather.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'},
]


def test_published_function_calling_prompt():
    assert render_chat(TOOL_TURN, TOOLS, "high", current_date=DATE) == PUBLISHED_TOOL_PROMPT
    # the thinking may come as vLLM's older name or transformers' `thinking`; the tool named by `name`
    for key in ("reasoning_content", "thinking"):
        turn = [dict(m) for m in TOOL_TURN]
        turn[2][key] = turn[2].pop("reasoning")
        turn[3] = {"role": "tool", "name": "get_weather", "content": turn[3]["content"]}
        assert render_chat(turn, TOOLS, "high", current_date=DATE) == PUBLISHED_TOOL_PROMPT


def test_answered_turn_drops_its_thinking():
    """format.md "Handling reasoning output in subsequent sampling" (history ends in <|end|>, as its
    implementation note says), and a finished tool-calling turn loses its thinking too."""
    ask = [{"role": "user", "content": "What is 2 + 2?"},
           {"role": "assistant", "content": "2 + 2 = 4.", "reasoning": 'User asks: "What is 2 + 2?"'},
           {"role": "user", "content": "What about 9 / 2?"}]
    text = render_chat(ask, current_date=DATE)
    assert text.endswith("<|start|>user<|message|>What is 2 + 2?<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
                         "<|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant")
    assert "Reasoning: medium" in text and "User asks" not in text and "developer" not in text
    assert "commentary channel: 'functions'" not in text  # no tools
    done = TOOL_TURN + [{"role": "assistant", "content": "Sunny, 20 degrees."}]
    text = render_chat(done, TOOLS, current_date=DATE)
    assert "Need to use function get_weather." not in text and "to=functions.get_weather <|constrain|>json" in text
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>Sunny, 20 degrees.<|end|><|start|>assistant")


def test_instructions_preamble_and_continuation():
    text = render_chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hel"}], continue_final_message=True,
                       add_generation_prompt=False, current_date=DATE, reasoning_effort="low")
    assert "Reasoning: low" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in text
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>Hel")
    preamble = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}]
    assert "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>" \
           "commentary to=functions.get_weather" in render_chat(preamble, current_date=DATE)


def test_schema_types():
    nested = {"type": "object", "properties": {
        "n": {"type": "integer", "default": 3}, "ok": {"type": "boolean"}, "tag": {"type": "string", "default": "x"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
        "maybe": {"type": "string", "nullable": True}, "either": {"type": ["string", "integer"]},
        "pick": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "raw": {}}, "required": ["n"]}
    assert schema_type(nested) == (
        "{\nn: number, // default: 3\nok?: boolean,\ntag?: string, // default: \"x\"\n"
        "where?: {\n    lat: number,\n    },\nmaybe?: string | null,\neither?: string | number,\n"
        "pick?: string | null,\nraw?: any,\n}")
    assert schema_type({"type": "array"}) == "Array<any>"


@pytest.mark.parametrize("messages, tools, message", [
    ([{"role": "tool", "content": "x"}], None, "messages[0]: a tool message needs"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], None, "messages[1]: role 'system'"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], None, "messages[0].content: only text"),
    ([{"role": "user", "content": "a"}], [{"type": "code_interpreter"}], "tools[0]: only function tools"),
])
def test_bad_conversations(messages, tools, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        render_chat(messages, tools)
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        render_chat([{"role": "user", "content": "a"}], reasoning_effort="max")

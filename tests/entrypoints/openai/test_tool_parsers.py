"""Tool-call parsers, whole and streamed: streamed pieces of any size assemble to the non-streamed result."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.entrypoints.openai.tool_parsers import ToolParserManager
from vlite.entrypoints.openai.tool_parsers.constrained import (NamedToolCallParser, RequiredToolCallParser,
                                                               required_schema)

HERMES = ToolParserManager.get_tool_parser("hermes")
LLAMA = ToolParserManager.get_tool_parser("llama3_json")


def streamed(make, text: str, max_piece: int, seed: int):
    """Feed `text` in random pieces; assemble deltas as the openai client's stream helpers do."""
    rng = random.Random(seed)
    parser, pieces, i = make(), [], 0
    while i < len(text):
        k = rng.randint(1, max_piece)
        pieces.append(text[i:i + k])
        i += k
    content, calls = "", {}
    for delta in [parser.extract_tool_calls_streaming(p) for p in pieces] + [parser.finish_streaming()]:
        content += delta.content
        for tc in delta.tool_calls:
            if "id" in tc:  # the first delta of a call: index, id, type, name
                assert tc["index"] not in calls and tc["type"] == "function"
                assert tc["id"].startswith("chatcmpl-tool-")
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [calls[k] for k in sorted(calls)]


def whole(make, text: str):
    out = make().extract_tool_calls(text)
    assert out.tools_called == bool(out.tool_calls)
    for tc in out.tool_calls:
        assert tc["id"].startswith("chatcmpl-tool-") and len(tc["id"]) > 20 and tc["type"] == "function"
    return out.content, [dict(tc["function"]) for tc in out.tool_calls]


def check_stream_matches(make, text: str):
    expected = whole(make, text)
    for seed in range(20):
        for max_piece in (1, 3, 16):
            assert streamed(make, text, max_piece, seed) == expected, (seed, max_piece)
    return expected


def test_hermes_calls_and_surrounding_content():
    text = ('I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit":"celsius", "days": [1, 2.50, -0, 1e3], "ok": true, "none": null, "o": {}}}\n</tool_call>\n'
            '<tool_call>\n{"arguments": {"q": "caf\\u00e9 \\ud83d\\ude00 \\"x\\"\\n"}, "name": "search"}\n</tool_call>')
    content, calls = check_stream_matches(HERMES, text)
    assert content == "I will look that up."
    assert [c["name"] for c in calls] == ["get_weather", "search"]
    assert calls[0]["arguments"] == json.dumps({"city": "Paris", "unit": "celsius", "days": [1, 2.5, 0, 1000.0],
                                                "ok": True, "none": None, "o": {}}, ensure_ascii=False)
    assert json.loads(calls[1]["arguments"]) == {"q": 'café 😀 "x"\n'}
    # Content between and after calls is kept; a call without arguments gets {}.
    content, calls = check_stream_matches(HERMES, 'a <tool_call>{"name": "f"}</tool_call> b\n')
    assert content == "a  b" and calls == [{"name": "f", "arguments": "{}"}]


@pytest.mark.parametrize("text", [
    "Just an answer, no tools.",
    "<tool_call>not json</tool_call> then text",
    '<tool_call>{"arguments": {}}</tool_call>',             # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',   # name not a string
    '<tool_call>["f"]</tool_call>',
    "ends with a partial marker <tool_ca",
    "",
])
def test_hermes_malformed_output_is_content(text):
    content, calls = check_stream_matches(HERMES, text)
    assert calls == [] and content == (text.strip() or None)


def test_hermes_unterminated_call_at_the_end():
    content, calls = check_stream_matches(HERMES, 'ok <tool_call>\n{"name": "f", "arguments": {"a": [1]}}')
    assert content == "ok" and calls == [{"name": "f", "arguments": '{"a": [1]}'}]


def test_hermes_streams_name_first_then_argument_fragments():
    parser = HERMES()
    deltas = [parser.extract_tool_calls_streaming(p) for p in
              ["Sure", ". <tool", "_call>{\"name\": \"lookup\"", ", \"arguments\": {\"text\": \"long ", "string",
               "\"}}</tool_call>"]]
    assert deltas[0].content == "Sure" and deltas[1].content == "."  # the partial marker is held back
    assert deltas[2].tool_calls[0]["function"] == {"name": "lookup", "arguments": ""}
    assert [d.tool_calls[0]["function"]["arguments"] for d in deltas[3:]] == ['{"text": "long ', "string", '"}']
    assert not parser.finish_streaming()


def test_llama3_json():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": "b"}}; {"name": "g", "arguments": {"n": 1}}'
    content, calls = check_stream_matches(LLAMA, text)
    assert content is None and calls == [{"name": "f", "arguments": '{"a": "b"}'}, {"name": "g", "arguments":
                                                                                     '{"n": 1}'}]
    content, calls = check_stream_matches(LLAMA, '  {"name": "f", "parameters": {}}\nDone.')
    assert calls == [{"name": "f", "arguments": "{}"}] and content == "Done."


@pytest.mark.parametrize("text", ['{"answer": 42}', 'Hello {"name": "f", "parameters": {}}', "plain text",
                                  "<|python_tag|>", "{not json", '{"nam'])
def test_llama3_json_non_calls_are_content(text):
    content, calls = check_stream_matches(LLAMA, text)
    assert calls == [] and content == (text.strip() or None)


def test_call_cut_off_after_its_name():
    """Output cut (max_tokens) inside a call: the whole parse cannot use it (content); a stream has already
    sent the name, and ends the call with the arguments it got (vLLM does the same)."""
    for make, text in [(LLAMA, '{"name": "f", "parameters": {"a": '), (HERMES, '<tool_call>{"name": "f", "ar')]:
        assert whole(make, text) == (text.strip(), [])
        content, calls = streamed(make, text, 4, 0)
        assert content is None and [c["name"] for c in calls] == ["f"]


def test_required_array_and_named_arguments():
    text = '[{"name": "a", "parameters": {"x": "1 \\"q\\""}}, {"name": "b", "parameters": {}}]'
    content, calls = check_stream_matches(RequiredToolCallParser, text)
    assert content is None and calls == [{"name": "a", "arguments": '{"x": "1 \\"q\\""}'},
                                         {"name": "b", "arguments": "{}"}]
    content, calls = check_stream_matches(lambda: NamedToolCallParser("fn"), '{"city":  "Paris", "n": [1,2]}')
    assert calls == [{"name": "fn", "arguments": '{"city": "Paris", "n": [1, 2]}'}]
    # Not an array of calls (e.g. cut by max_tokens): content.
    assert whole(RequiredToolCallParser, '[{"name": "a", "par') == ('[{"name": "a", "par', [])


def test_required_schema():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}}, {"type": "function", "function": {"name": "b"}}]
    schema = required_schema(tools, parallel_tool_calls=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["a"], ["b"]]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate([{"name": "a", "parameters": {"x": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"x": "1"}}], schema)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(args=st.dictionaries(st.text(max_size=6), json_values, max_size=4), indent=st.sampled_from([None, 2]),
       ascii_=st.booleans(), seed=st.integers(0, 2**16), piece=st.integers(1, 9))
def test_streamed_arguments_equal_the_whole_parse(args, indent, ascii_, seed, piece):
    """Any arguments, in any JSON spelling (escapes, spacing), streamed in any pieces: the same call."""
    body = json.dumps({"name": "f", "arguments": args}, indent=indent, ensure_ascii=ascii_)
    text = f"pre <tool_call>\n{body}\n</tool_call>"
    expected = whole(HERMES, text)
    assert expected == ("pre", [{"name": "f", "arguments": json.dumps(args, ensure_ascii=False)}])
    assert streamed(HERMES, text, piece, seed) == expected


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="hermes"):
        ToolParserManager.get_tool_parser("nope")

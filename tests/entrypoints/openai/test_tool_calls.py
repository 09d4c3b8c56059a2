"""Tool calling in /v1/chat/completions through the official openai client, on a real server over the
default model. SmolLM2's own chat template ignores `tools`, so the server gets a small Hermes-format
template (the shape of Qwen 2.5's) with --chat-template, and reads calls with --tool-call-parser hermes."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import start_server, stop_server

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You are a function calling AI model. You may call one or more functions. Here are the available tools: <tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12},
                                                    "hours24": {"type": "boolean"}},
                   "required": ["zone", "hours24"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
CITY_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE)
    srv = start_server(tmp_path_factory, "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                       "--chat-template", str(path))
    yield srv
    assert stop_server(srv) == 0, open(srv.log_path).read()[-3000:]


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key=tools_server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def check_calls(calls, names) -> None:
    assert calls and (names is None or [c.function.name for c in calls] == names)
    for c in calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


def assembled(client, **kwargs):
    """The official client's stream helper assembles the deltas into a completion."""
    return streamed(client, **kwargs)[0]


def streamed(client, **kwargs):
    """(the completion the client's stream helper assembles, the raw chunks' first-choice deltas)."""
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [e.chunk.choices[0].delta for e in stream if e.type == "chunk" and e.chunk.choices]
        return stream.get_final_completion(), deltas


def same_calls(a, b) -> None:
    assert [(c.function.name, c.function.arguments) for c in a] == [(c.function.name, c.function.arguments) for c in b]


def test_required_tool_choice_always_calls_valid_tools(client, model):
    # One call (parallel_tool_calls=False: an array of one; the 135M model would repeat calls until max_tokens).
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0,
                  parallel_tool_calls=False)
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    check_calls(choice.message.tool_calls, None)
    assert len(choice.message.tool_calls) == 1
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    streamed = assembled(client, **kwargs).choices[0]
    same_calls(streamed.message.tool_calls, choice.message.tool_calls)
    assert streamed.finish_reason == "tool_calls"
    # Sampled, several choices: still valid.
    sampled = client.chat.completions.create(**{**kwargs, "temperature": 1.0, "n": 3, "seed": 5})
    for c in sampled.choices:
        check_calls(c.message.tool_calls, None)
        assert len(c.message.tool_calls) == 1


def test_required_parallel_calls_stream_as_the_whole_response(client, model):
    """Parallel calls allowed (the default): the array may hold several (the model writes two here)."""
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[CITY_WEATHER],
                  tool_choice="required", max_tokens=100,
                  temperature=0)
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "tool_calls", out
    assert [c.function.name for c in out.message.tool_calls] == ["get_weather"] * len(out.message.tool_calls)
    for c in out.message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), CITY_WEATHER["function"]["parameters"])
    assert len({c.id for c in out.message.tool_calls}) == len(out.message.tool_calls)
    same_calls(assembled(client, **kwargs).choices[0].message.tool_calls, out.message.tool_calls)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_arguments_validate(client, model, name):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
                  tool_choice={"type": "function", "function": {"name": name}})
    out = client.chat.completions.create(**kwargs).choices[0]
    check_calls(out.message.tool_calls, [name])
    assert out.finish_reason == "stop"  # as OpenAI answers a forced function
    final, chunks = streamed(client, **kwargs)
    same_calls(final.choices[0].message.tool_calls, out.message.tool_calls)
    # Raw deltas: the first of the call carries id, type and name; the rest only argument fragments.
    deltas = [tc for d in chunks for tc in (d.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == name
    assert all(d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    assert "".join(d.function.arguments or "" for d in deltas) == out.message.tool_calls[0].function.arguments


# tool_choice "auto": the model decides, its output read by the server's parser (hermes). To have the 135M
# model write calls whatever it would choose, its output is held to a Hermes-format regex (vLLM's
# structured_outputs field): real generated tokens, detokenized and parsed as any model's would be.
WEATHER_ARGS = r'"city": "[A-Z][a-z]{2,8}", "unit": "celsius"'
TIME_ARGS = r'"zone": "[A-Z][a-z]{2,8}", "hours24": (true|false)'
CALL = r'<tool_call>\n\{"name": "%s", "arguments": \{%s\}\}\n</tool_call>'
AUTO_REGEX = r"I will check the weather\. " + CALL % ("get_weather", WEATHER_ARGS) + r"\n" + \
    CALL % ("get_time", TIME_ARGS)


def test_auto_tool_calls_parsed_and_streamed(client, model):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=150, temperature=0,
                  extra_body={"structured_outputs": {"regex": AUTO_REGEX}})
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.message.content == "I will check the weather."
    check_calls(out.message.tool_calls, ["get_weather", "get_time"])
    assert out.finish_reason == "tool_calls"
    final, chunks = streamed(client, **kwargs)
    same_calls(final.choices[0].message.tool_calls, out.message.tool_calls)
    assert final.choices[0].message.content == out.message.content
    assert final.choices[0].finish_reason == "tool_calls"
    # The content streams before the calls; each call's first delta names it.
    first_call = next(i for i, d in enumerate(chunks) if d.tool_calls)
    assert "".join(d.content or "" for d in chunks[:first_call]) == out.message.content
    assert not any(d.content for d in chunks[first_call:])
    assert [tc.function.name for d in chunks for tc in d.tool_calls or [] if tc.id] == ["get_weather", "get_time"]
    # parallel_tool_calls=False: the first call only.
    one = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
    same_calls(one.message.tool_calls, out.message.tool_calls[:1])
    # Without a call the output is content, finish_reason as generated.
    text = client.chat.completions.create(**{**kwargs, "extra_body": {"structured_outputs": {
        "regex": "Sunny, 21 degrees\\."}}}).choices[0]
    assert text.message.content == "Sunny, 21 degrees." and not text.message.tool_calls
    assert text.finish_reason == "stop"


def test_conversation_with_a_tool_result_continues(tools_server, client, model):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function",
                                                               "function": {"name": "get_weather",
                                                                            "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    # The history reaches the template in the shape HF templates expect (arguments as a dict).
    ids = httpx.post(f"{tools_server.url}/tokenize", json={"messages": messages}, headers=tools_server.headers)
    prompt = httpx.post(f"{tools_server.url}/detokenize", json={"tokens": ids.json()["tokens"]},
                        headers=tools_server.headers).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in prompt
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert out.usage.prompt_tokens > len(ids.json()["tokens"])  # the tools were rendered too


def test_tool_choice_none_returns_content(client, model):
    kwargs = dict(model=model, messages=ASK, max_tokens=16, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0]
    out = client.chat.completions.create(tools=TOOLS, tool_choice="none", **kwargs)
    choice = out.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    # The tools are in the prompt (vLLM's default for "none"), so it differs from the plain request.
    assert out.usage.prompt_tokens > client.chat.completions.create(**kwargs).usage.prompt_tokens
    assert plain.message.content


def error_of(server, body):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)
    err = r.json()["error"]
    return r.status_code, err["param"], err["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [{"type": "function"}]}, "tools.0.function", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters",
     ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools",
     "nonsense"),
    ({"tools": TOOLS, "tool_choice": "required", "messages": ASK + [
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": "{nope"}}]}]},
     "messages", "arguments"),
])
def test_tool_request_errors_name_the_field(tools_server, body, param, words):
    status, got_param, message = error_of(tools_server, {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and got_param == param and words in message, message


def test_auto_needs_the_server_flags(server):
    """The shared server runs without --enable-auto-tool-choice: tools with the default tool_choice
    ("auto") are refused with vLLM's message; "none" works."""
    status, param, message = error_of(server, {"messages": ASK, "tools": TOOLS, "max_tokens": 4})
    assert status == 400 and param == "tool_choice" and "--enable-auto-tool-choice" in message
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=60,
                   json={"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_offline_chat_renders_tools_and_history(llm_fp32):
    """LLM.chat(tools=...) as vLLM's: the template gets the tools and the history's arguments as dicts; the
    server's parsers read the output offline too."""
    from vlite import SamplingParams
    from vlite.entrypoints.openai.tool_parsers import ToolParserManager
    from vlite.sampling_params import StructuredOutputsParams

    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": "rain"}, {"role": "user", "content": "And Paris?"}]
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(regex=AUTO_REGEX))
    out = llm_fp32.chat(history, params, use_tqdm=False, chat_template=HERMES_TEMPLATE, tools=TOOLS)[0]
    assert json.dumps(WEATHER) in out.prompt and '"arguments": {"city": "Lyon"}' in out.prompt
    parsed = ToolParserManager.get_tool_parser("hermes")().extract_tool_calls(out.outputs[0].text)
    assert parsed.content == "I will check the weather."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    for c in parsed.tool_calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


@pytest.mark.parametrize("flags, words", [(["--tool-call-parser", "nope"], "hermes"),
                                          (["--enable-auto-tool-choice"], "requires --tool-call-parser")])
def test_bad_tool_flags_fail_before_loading(flags, words):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "vlite", "serve", "--port", "1", *flags], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and words in r.stderr, r.stderr

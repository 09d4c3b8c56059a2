"""`vlite serve --reasoning-parser qwen3` on the tiny thinking model, through the official openai client:
message.reasoning (and reasoning_content) apart from content, streamed deltas adding up to them byte for
byte (a block cut at max_tokens, tags split across tokens, text after the answer), the switches
(enable_thinking, include_reasoning), tool calls read from the answer only, and a JSON schema on the answer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import start_server, stop_server
from tests.reasoning import thinking_model as tm

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, thinking_model_dir):
    srv = start_server(tmp_path_factory, "--model", str(thinking_model_dir), "--reasoning-parser", "qwen3",
                       "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--trust-request-chat-template",
                       "--kv-cache-memory", "8MiB", "--max-model-len", "256")
    yield srv
    assert stop_server(srv) == 0, open(srv.log_path).read()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def both(client, **kwargs) -> tuple:
    """The non-streamed message and the streamed deltas' concatenation; they must agree byte for byte."""
    kwargs = {"model": client.models.list().data[0].id, "messages": ASK, "temperature": 0, "max_tokens": 40, **kwargs}
    choice = client.chat.completions.create(**kwargs).choices[0]
    message = choice.message
    reasoning = getattr(message, "reasoning", None)
    assert getattr(message, "reasoning_content", None) == reasoning  # vLLM's older name beside the new one
    parts: dict[str, list] = {"reasoning": [], "content": [], "order": [], "calls": []}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            d = c.delta
            r = getattr(d, "reasoning", None)
            assert getattr(d, "reasoning_content", None) == r
            if r:
                parts["reasoning"].append(r)
                parts["order"].append("r")
            if d.content:
                parts["content"].append(d.content)
                parts["order"].append("c")
            parts["calls"].extend(d.tool_calls or [])
            finish = c.finish_reason or finish
    streamed_reasoning = "".join(parts["reasoning"]) or None
    streamed_content = "".join(parts["content"]) or None
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content or None)
    assert "".join(parts["order"]) == "".join(sorted(parts["order"], reverse=True))  # reasoning first
    assert finish == choice.finish_reason
    return reasoning, message.content, message.tool_calls, parts["calls"], choice.finish_reason


def test_reasoning_apart_streamed_and_not(client) -> None:
    assert both(client)[:2] == (tm.REASONING, tm.ANSWER)
    # Thinking off (the template writes an empty block): all answer.
    assert both(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})[:2] == (None, "Paris it is.")
    # Cut inside the block at max_tokens: all reasoning.
    reasoning, content, _, _, finish = both(client, max_tokens=3)
    assert (reasoning, content, finish) == ("\nPonder" + tm.DECOY, None, "length")
    # Tags split across tokens ("</t" "hink>"), text after the answer.
    assert both(client, extra_body={"chat_template": tm.SPLIT_TEMPLATE})[:2] == ("Split here", " after answer")
    # include_reasoning false: the thinking is left out, the answer is the same.
    assert both(client, extra_body={"include_reasoning": False})[:2] == (None, tm.ANSWER)


def test_tool_calls_from_the_answer_only(client, server) -> None:
    # The thinking holds a <tool_call> block (a decoy): not a call.
    reasoning, content, calls, streamed_calls, finish = both(client, tools=[WEATHER, TIME])
    assert reasoning == tm.REASONING and not calls and not streamed_calls and finish == "stop"
    assert content == tm.ANSWER.strip()  # the tool parser strips the answer's ends
    # Biased away from the text answer, the model calls get_weather in its answer.
    tok = tm.tokenizer()
    bias = {str(tok.convert_tokens_to_ids("\n\n")): -100}
    reasoning, content, calls, streamed_calls, finish = both(client, tools=[WEATHER, TIME], logit_bias=bias)
    assert reasoning == tm.REASONING and finish == "tool_calls" and not content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert [c.function.name for c in streamed_calls if c.function.name] == ["get_weather"]


def test_json_schema_and_required_tools_constrain_the_answer(client) -> None:
    pytest.importorskip("xgrammar")
    schema = {"type": "array", "items": {"type": "object"}}
    reasoning, content, *_ = both(client, response_format={"type": "json_schema", "json_schema": {
        "name": "calls", "schema": schema}})
    assert reasoning == tm.REASONING and json.loads(content)[0]["name"] == "get_weather"
    reasoning, content, calls, _, finish = both(client, tools=[WEATHER], tool_choice="required")
    assert reasoning == tm.REASONING and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_bad_kwargs_name_the_field(server) -> None:
    body = {"messages": ASK, "max_tokens": 2}
    for kwargs, needle in [({"enable_thinking": "no"}, "enable_thinking must be true or false"),
                           ({"tokenize": True}, "may not set ['tokenize']")]:
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers,
                       json={**body, "chat_template_kwargs": kwargs}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert needle in r.json()["error"]["message"]


def test_default_chat_template_kwargs() -> None:
    """--default-chat-template-kwargs apply to every request; a request's own chat_template_kwargs win."""
    from types import SimpleNamespace

    from vlite.engine.arg_utils import EngineArgs
    from vlite.entrypoints.cli.serve import _json_kwargs
    from vlite.entrypoints.openai.protocol import ChatCompletionRequest
    from vlite.entrypoints.openai.serving_chat import OpenAIServingChat

    engine = SimpleNamespace(tokenizer=tm.tokenizer(), engine_args=EngineArgs(reasoning_parser="qwen3"))
    chat = OpenAIServingChat(engine, None, default_chat_template_kwargs=_json_kwargs('{"enable_thinking": false}'))
    assert chat.reasoning_parser_cls.__name__ == "Qwen3ReasoningParser"
    text, _ = chat.render_chat(ChatCompletionRequest(messages=ASK))
    assert text.endswith("<think>\n\n</think>\n\n") and chat.reasoning_parser_cls.prompt_phase(text) == "content"
    text, _ = chat.render_chat(ChatCompletionRequest(messages=ASK, chat_template_kwargs={"enable_thinking": True}))
    assert text.endswith("assistant\n") and chat.reasoning_parser_cls.prompt_phase(text) == "pending"
    with pytest.raises(Exception, match="--default-chat-template-kwargs must be a JSON object"):
        _json_kwargs("[1]")

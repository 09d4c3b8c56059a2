"""`vlite serve` on a tiny model that answers in harmony (tests/harmony/harmony_model.py), through the
official openai client: the chat rendered in harmony (the model's tokenizer has harmony's special tokens),
`message.reasoning` from the analysis channel, `tool_calls` from a call to functions.get_weather (stopped at
<|call|>), the call and its result sent back and answered from the final channel (stopped at <|return|>);
streamed deltas add up to the non-streamed message."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import start_server, stop_server
from tests.harmony import harmony_model as hm
from vlite.harmony import render_chat

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, harmony_model_dir):
    srv = start_server(tmp_path_factory, "--model", str(harmony_model_dir), "--reasoning-parser", "openai_gptoss",
                       "--tool-call-parser", "openai", "--enable-auto-tool-choice", "--kv-cache-memory", "16MiB",
                       "--max-model-len", "1024")
    yield srv
    assert stop_server(srv) == 0, open(srv.log_path).read()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def ban(*texts: str) -> dict[str, int]:
    tok = hm.tokenizer()
    return {str(hm.token_id(tok, t)): -100 for t in texts}


def both(client, **kwargs):
    """The non-streamed choice and the streamed one rebuilt from its deltas; they must agree."""
    kwargs = {"model": client.models.list().data[0].id, "messages": ASK, "temperature": 0, "max_tokens": 40, **kwargs}
    choice = client.chat.completions.create(**kwargs).choices[0]
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if getattr(c.delta, "reasoning", None):
                reasoning.append(c.delta.reasoning)
            if c.delta.content:
                content.append(c.delta.content)
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    m = choice.message
    assert ("".join(reasoning) or None) == getattr(m, "reasoning", None) == getattr(m, "reasoning_content", None)
    assert ("".join(content) or None) == (m.content or None)
    assert [tuple(v) for v in calls.values()] == [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    assert finish == choice.finish_reason
    return choice


def test_prompt_is_harmony(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": ASK}, headers=server.headers).json()["tokens"]
    text = hm.tokenizer().decode(tokens, skip_special_tokens=False)
    assert re.sub(r"Current date: \S+", "Current date: DATE", text) == render_chat(ASK, current_date="DATE")
    assert "Reasoning: medium" in text and text.endswith("<|start|>user<|message|>Weather in Paris?<|end|>"
                                                          "<|start|>assistant")


def test_reasoning(client):
    choice = both(client, max_tokens=12)  # the chain thinks again and again: cut at max_tokens
    assert choice.finish_reason == "length" and not choice.message.content
    assert choice.message.reasoning.startswith("Weigh it.\nWeigh it.")
    hidden = both(client, max_tokens=12, extra_body={"include_reasoning": False})
    assert getattr(hidden.message, "reasoning", None) is None


def test_tool_call_round_trip(client):
    call = both(client, tools=[WEATHER], reasoning_effort="high", logit_bias=ban("analysis", "Weigh it."))
    assert call.finish_reason == "tool_calls" and call.message.content is None
    (tc,) = call.message.tool_calls
    assert (tc.function.name, tc.function.arguments) == ("get_weather", hm.ARGS) and tc.id.startswith("chatcmpl-tool-")
    history = ASK + [call.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": '{"sunny": true}'}]
    answer = both(client, messages=history, tools=[WEATHER],
                  logit_bias=ban("analysis", "Weigh it.", hm.RECIPIENT, hm.ARGS))
    assert answer.finish_reason == "stop" and answer.message.content == "Sunny in Paris."
    assert not answer.message.tool_calls


def test_harmony_rules(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match='"auto" and "none" only'):
        client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="a tool message needs"):
        client.chat.completions.create(model=model, messages=[{"role": "tool", "content": "x",
                                                                "tool_call_id": "nope"}])
    # tool_choice "none": a call the model makes anyway is not returned as one
    none = both(client, tools=[WEATHER], tool_choice="none", logit_bias=ban("analysis", "Weigh it."))
    assert none.finish_reason == "stop" and not none.message.tool_calls and none.message.content == ""

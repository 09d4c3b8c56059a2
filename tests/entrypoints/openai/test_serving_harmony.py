"""The harmony side of /v1/chat/completions (serving_harmony): the prompt rendered from a request (its
reasoning_effort, tools, and history calls as the model wrote them), the sampling it needs, and a choice's
message and stream chunks (reasoning and tool calls together), the chunks adding up to the message."""

from __future__ import annotations

from dataclasses import dataclass

from tests.entrypoints.openai.test_openai_tool_parser import TWO_CALLS, streamed_calls
from tests.harmony.test_parser import ARITHMETIC, TOOL_CALL
from vlite.entrypoints.openai.protocol import ChatCompletionRequest
from vlite.entrypoints.openai.serving_harmony import HarmonyChat, full_message, new_parser, stream_delta

PROMPT = "<|start|>user<|message|>Weather?<|end|><|start|>assistant"


@dataclass
class Tools:  # what serving_chat's _Tools offers the helpers
    parallel: bool = True


def test_render_and_prepare():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    request = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"},
        {"role": "assistant", "content": None, "reasoning": "Call f.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}], reasoning_effort="low", stop_token_ids=[5])
    messages = [{"role": m.role, "content": m.content or "", **({"tool_call_id": m.tool_call_id} if m.tool_call_id
                                                                 else {})} for m in request.messages]
    text = HarmonyChat.render(request, messages, {"model_identity": "You are Tiny."})
    assert text.startswith("<|start|>system<|message|>You are Tiny.\nKnowledge cutoff:") and "Reasoning: low" in text
    assert "# Instructions\n\nBe brief." in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Call f.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.f <|constrain|>json<|message|>{"a":1}<|call|><|start|>functions.f to=assistant<|channel|>'
            "commentary<|message|>1<|end|><|start|>assistant") in text
    HarmonyChat([9, 7], True).prepare(request)
    params = request.to_sampling_params(8)
    assert params.skip_special_tokens is False and params.stop_token_ids == [5, 9, 7]


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

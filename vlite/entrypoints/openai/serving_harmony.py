"""/v1/chat/completions for harmony models (gpt-oss), as vLLM serves them: the prompt rendered from the
messages, tools and `reasoning_effort` in Python (vlite.harmony) rather than by the Jinja template, every
output read back by harmony's channels: `analysis` -> `reasoning`, `final` -> `content`, calls to
`functions.NAME` -> `tool_calls` (with tool_choice "auto": --tool-call-parser openai
--enable-auto-tool-choice). The split needs no --reasoning-parser (vLLM's rule for gpt-oss); naming
`openai_gptoss` also lets the engine constrain only the answer and enforce a thinking budget.

Why Python and not the model's template (gpt-oss ships one for the same format): the template writes a
history tool call differently from how the model wrote it (the recipient in the role's part, `json` without
`<|constrain|>`, the tool's output JSON-quoted), so a tool-calling turn's prompt would not be the text the
model produced; the Python renderer follows harmony's published examples, which are the model's own
output. `--chat-template` (or a request's chat_template) still selects a template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vlite.entrypoints.openai.tool_parsers.abstract_tool_parser import tool_call
from vlite.entrypoints.openai.tool_parsers.openai_tool_parser import call_deltas
from vlite.harmony import (HarmonyHeader, HarmonyParser, collect, is_harmony_tokenizer, prompt_inside,
                           render_chat, stop_token_ids)


@dataclass
class HarmonyChat:
    """The harmony side of one server's chat handler (None there when the model does not speak harmony)."""

    stop_ids: list[int]
    render_in_python: bool  # False: a server --chat-template renders the prompts

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, server_chat_template: Optional[str]) -> Optional[HarmonyChat]:
        if not is_harmony_tokenizer(tokenizer):
            return None
        return cls(stop_token_ids(tokenizer), server_chat_template is None)

    def renders(self, request: Any) -> bool:
        return self.render_in_python and getattr(request, "chat_template", None) is None

    @staticmethod
    def render(request: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        """The prompt: harmony's own rendering. chat_template_kwargs' `reasoning_effort` and `model_identity`
        (gpt-oss's template variables) are honoured; the request's reasoning_effort wins."""
        for m, src in zip(messages, request.messages):
            for key in ("reasoning", "reasoning_content"):
                if getattr(src, key, None) is not None:
                    m[key] = getattr(src, key)
            if src.tool_calls:  # the arguments as the model wrote them (the template's copy is a dict)
                m["tool_calls"] = [{"id": tc.id, "function": {"name": tc.function.name,
                                                              "arguments": tc.function.arguments}}
                                   for tc in src.tool_calls]
        effort = getattr(request, "reasoning_effort", None) or kwargs.get("reasoning_effort")
        extra = {"model_identity": kwargs["model_identity"]} if isinstance(kwargs.get("model_identity"), str) else {}
        return render_chat(messages, kwargs.get("tools"), effort,
                           add_generation_prompt=request.add_generation_prompt,
                           continue_final_message=getattr(request, "continue_final_message", False), **extra)

    def prepare(self, request: Any) -> None:
        """The request's sampling as harmony needs it: the special tokens kept in the text (the parser reads
        the channels off them) and generation stopped at <|return|> and <|call|>."""
        request.skip_special_tokens = False
        request.stop_token_ids = list(request.stop_token_ids or []) + \
            [i for i in self.stop_ids if i not in (request.stop_token_ids or [])]


def new_parser(prompt: str) -> HarmonyParser:
    """The parser of one choice's output: inside the answer when the prompt left it open."""
    inside: Optional[HarmonyHeader] = prompt_inside(prompt)
    return HarmonyParser(inside=inside)


def full_message(prompt: str, text: str, tools: Any, include_reasoning: bool) -> tuple[dict[str, Any], bool]:
    """A non-streamed choice's message, and whether it called tools (read only where `tools` says "auto")."""
    parser = new_parser(prompt)
    parsed = collect([parser.feed(text), parser.finish()])
    calls = parsed.calls if tools is not None else []
    if calls and not tools.parallel:
        calls = calls[:1]
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content if calls else parsed.content or ""}
    if include_reasoning:
        message["reasoning"] = message["reasoning_content"] = parsed.reasoning
    if calls:
        message["tool_calls"] = [tool_call(name, arguments) for name, arguments in calls]
    return message, bool(calls)


def stream_delta(parser: HarmonyParser, text: str, finished: bool, tools: Any,
                 include_reasoning: bool) -> tuple[dict[str, Any], bool]:
    """One streamed piece of a choice as a chunk's delta, and whether the choice has called tools so far."""
    d = parser.feed(text)
    if finished:
        d.extend(parser.finish())
    delta: dict[str, Any] = {}
    if include_reasoning and d.reasoning:
        delta["reasoning"] = delta["reasoning_content"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    calls = call_deltas(d.calls) if tools is not None else []
    if tools is not None and not tools.parallel:
        calls = [c for c in calls if c["index"] == 0]
    if calls:
        delta["tool_calls"] = calls
    return delta, tools is not None and parser.num_calls > 0

"""Chat messages and OpenAI tools rendered as a harmony prompt (gpt-oss's chat format).

    <|start|>system<|message|>{identity, dates, Reasoning: EFFORT, # Valid channels ...}<|end|>
    <|start|>developer<|message|># Instructions\n\n{system prompt}\n\n# Tools\n\n## functions ...<|end|>
    <|start|>user<|message|>...<|end|>
    <|start|>assistant<|channel|>final<|message|>{an earlier answer}<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{thinking of an unfinished tool-calling turn}<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>
    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>{tool output}<|end|>
    <|start|>assistant

The request's system (or developer) messages at the start are the developer message's instructions: harmony's
own system message carries the model identity, the dates, the reasoning effort and the channels
(harmony docs/format.md; gpt-oss's chat template does the same). An earlier turn that ended in an answer
keeps only its answer (its thinking is dropped); a turn still calling tools keeps its thinking
(`reasoning`, `reasoning_content` or `thinking` on the assistant message). Tool calls are written as the
model writes them (format.md's function-calling example), so a conversation's history renders to the text
its earlier completions were.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Optional

from vlite.harmony.parser import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, SPECIAL_TOKENS, START, STOP_TOKENS
from vlite.harmony.typescript import tools_section

REASONING_EFFORTS = ("low", "medium", "high")
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
_THINKING_KEYS = ("reasoning", "reasoning_content", "thinking")


def _token_id(tokenizer: Any, token: str) -> Optional[int]:
    """The id of a token of the vocabulary (None when the tokenizer would map it to unknown)."""
    i = tokenizer.convert_tokens_to_ids(token) if hasattr(tokenizer, "convert_tokens_to_ids") else None
    unk = getattr(tokenizer, "unk_token_id", None)
    return i if isinstance(i, int) and (unk is None or i != unk) else None


def is_harmony_tokenizer(tokenizer: Any) -> bool:
    """Whether a tokenizer has harmony's special tokens (o200k_harmony: every gpt-oss checkpoint, Hugging Face
    or GGUF), so that its model's chats are harmony conversations."""
    return all(_token_id(tokenizer, t) is not None for t in SPECIAL_TOKENS)


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids of <|return|> and <|call|>, where generation stops (vLLM adds them to every harmony request)."""
    ids = [_token_id(tokenizer, t) for t in STOP_TOKENS]
    return [i for i in ids if i is not None]


def system_message(reasoning_effort: Optional[str] = None, has_tools: bool = False,
                   current_date: Optional[str] = None, model_identity: str = MODEL_IDENTITY) -> str:
    effort = reasoning_effort or "medium"
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}")
    date = current_date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    channels = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    if has_tools:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    body = (f"{model_identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date}\n\n"
            f"Reasoning: {effort}\n\n{channels}")
    return f"{START}system{MESSAGE}{body}{END}"


def developer_message(instructions: Optional[str], functions: list[dict[str, Any]]) -> str:
    sections = ["# Instructions", instructions] if instructions else []
    if functions:
        sections.append(tools_section(functions))
    body = "\n\n".join(sections)
    return f"{START}developer{MESSAGE}{body}{END}" if sections else ""


def render_chat(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None,
                reasoning_effort: Optional[str] = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, current_date: Optional[str] = None,
                model_identity: str = MODEL_IDENTITY) -> str:
    """The harmony prompt of an OpenAI-style conversation. Bad input (a message the format cannot hold) is a
    ValueError naming the message."""
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    i, instructions = 0, []
    while i < len(messages) and messages[i].get("role") in ("system", "developer"):
        instructions.append(_text(messages[i], i))
        i += 1
    parts = [system_message(reasoning_effort, bool(functions), current_date, model_identity),
             developer_message("\n\n".join(x for x in instructions if x) or None, functions)]
    rest = messages[i:]
    # An assistant message without tool calls is an answer: the turns before it are finished.
    last_answer = max((j for j, m in enumerate(rest) if m.get("role") == "assistant" and not m.get("tool_calls")),
                      default=-1)
    calls: dict[str, str] = {}  # tool_call_id -> function name, for the tool messages after the calls
    last_call: Optional[str] = None
    for j, m in enumerate(rest):
        where, role = i + j, m.get("role")
        if role == "user":
            parts.append(f"{START}user{MESSAGE}{_text(m, where)}{END}")
        elif role == "assistant" and m.get("tool_calls"):
            if j > last_answer:  # the turn goes on: the model needs its thinking before the calls
                thinking = next((m[k] for k in _THINKING_KEYS if isinstance(m.get(k), str) and m[k]), None)
                if thinking:
                    parts.append(f"{START}assistant{CHANNEL}analysis{MESSAGE}{thinking}{END}")
            if _text(m, where):
                parts.append(f"{START}assistant{CHANNEL}commentary{MESSAGE}{_text(m, where)}{END}")
            for k, call in enumerate(m["tool_calls"]):
                name, arguments = _call(call, where, k)
                calls[str(call.get("id"))] = last_call = name
                parts.append(f"{START}assistant{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"
                             f"{arguments}{CALL}")
        elif role == "assistant":
            is_open = continue_final_message and j == len(rest) - 1
            parts.append(f"{START}assistant{CHANNEL}final{MESSAGE}{_text(m, where)}{'' if is_open else END}")
        elif role == "tool":
            name = m.get("name") or calls.get(str(m.get("tool_call_id"))) or last_call
            if not name:
                raise ValueError(f"messages[{where}]: a tool message needs a preceding assistant tool call "
                                 "(or a name) to say which function it answers")
            parts.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{_text(m, where)}{END}")
        else:
            raise ValueError(f"messages[{where}]: role {role!r} cannot be rendered in the harmony format (system "
                             "and developer messages must come first; then user, assistant and tool)")
    if add_generation_prompt and not continue_final_message:
        parts.append(f"{START}assistant")
    return "".join(parts)


def _text(m: dict[str, Any], where: int) -> str:
    content = m.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"messages[{where}].content: only text is supported in the harmony format")


def _function(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if tool.get("type", "function") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise ValueError(f"tools[{i}]: only function tools with a name are supported")
    return function


def _call(call: dict[str, Any], where: int, k: int) -> tuple[str, str]:
    function = call.get("function") or {}
    name, arguments = function.get("name"), function.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"messages[{where}].tool_calls[{k}].function.name is missing")
    if not isinstance(arguments, str):  # a dict (transformers' convention): as JSON
        arguments = json.dumps(arguments, ensure_ascii=False)
    return name, arguments

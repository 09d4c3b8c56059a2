"""What every tool parser provides, and the streaming bookkeeping they share."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from vlite.entrypoints.openai.tool_parsers.json_stream import CallAssembler, JsonError, JsonLexer
from vlite.utils import held_prefix  # noqa: F401  (the parsers' import of it)


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of a message's `tool_calls`, in OpenAI's shape."""
    return {"id": make_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ExtractedToolCalls:
    """A whole output, parsed: the calls found and the text outside them (None when only whitespace)."""

    tools_called: bool
    tool_calls: list[dict[str, Any]]
    content: Optional[str]


@dataclass
class DeltaMessage:
    """What one streamed piece of output adds: content text and/or tool-call deltas (OpenAI's shape:
    the first delta of a call has index, id, type and function.name; later ones function.arguments)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: "DeltaMessage") -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def join_content(parts: list[str]) -> Optional[str]:
    """Content outside tool calls, as the streamed deltas add up to: stripped at both ends."""
    text = "".join(parts).strip()
    return text or None


class ToolParser:
    """Parses a model's output into tool calls, whole (`extract_tool_calls`) or as it streams
    (`extract_tool_calls_streaming` per piece of text, then `finish_streaming`). One instance per choice:
    the streaming state lives on it."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.num_calls = 0
        self._content_started = False
        self._held_ws = ""
        self._assembler: Optional[CallAssembler] = None
        self._lexer: Optional[JsonLexer] = None
        self._name_sent = False
        self._args_sent = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        raise NotImplementedError

    def finish_streaming(self) -> DeltaMessage:
        raise NotImplementedError

    # ---- streaming helpers -----------------------------------------------------------------------

    def _content(self, text: str) -> DeltaMessage:
        """Content as it streams, whitespace held back until more text follows it (so the streamed
        content adds up to the non-streamed, stripped one)."""
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return DeltaMessage()
            self._content_started = True
        text = self._held_ws + text
        kept = text.rstrip()
        self._held_ws = text[len(kept):]
        return DeltaMessage(content=kept)

    def _start_call(self, base: int = 0) -> None:
        self._assembler = CallAssembler(base)
        self._lexer = JsonLexer(self._assembler.on)
        self._name_sent = self._args_sent = False

    def _feed_call(self, text: str) -> tuple[DeltaMessage, int]:
        """Feed text of the current call's JSON; returns the deltas it completes and how much text was
        used (less than all once the object is closed). JsonError propagates."""
        assert self._lexer is not None
        used = self._lexer.feed(text)
        return self._call_deltas(), used

    def _call_deltas(self, final: bool = False) -> DeltaMessage:
        a = self._assembler
        assert a is not None
        out = DeltaMessage()
        if a.name is None:
            return out
        if not self._name_sent:
            self._name_sent = True
            out.tool_calls.append({"index": self.num_calls, "id": make_tool_call_id(), "type": "function",
                                   "function": {"name": a.name, "arguments": ""}})
            self.num_calls += 1
        args = a.take_args()
        if final and not self._args_sent and not args:
            args = "{}"  # a call without arguments: as the non-streamed parse gives it
        if args:
            self._args_sent = True
            out.tool_calls.append({"index": self.num_calls - 1, "function": {"arguments": args}})
        return out

    def _call_emitted(self) -> bool:
        return self._name_sent

    def _end_call(self) -> DeltaMessage:
        """The current call's last deltas; the call must have been recognised (a name seen)."""
        if self._lexer is not None:
            try:
                self._lexer.finish()
            except JsonError:
                pass
        out = self._call_deltas(final=True)
        self._assembler = self._lexer = None
        return out

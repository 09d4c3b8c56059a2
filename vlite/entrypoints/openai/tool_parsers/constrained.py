"""Outputs of `tool_choice="required"` and of a named function, generated under a JSON schema (as vLLM
does): "required" writes a JSON array of `{"name": ..., "parameters": {...}}` calls, a named function
writes its arguments object alone. The schemas, and the parsers of those outputs, whole and streamed."""

from __future__ import annotations

from typing import Any, Optional

from vlite.entrypoints.openai.tool_parsers.abstract_tool_parser import (DeltaMessage, ExtractedToolCalls,
                                                                       ToolParser, join_content,
                                                                       make_tool_call_id, tool_call)
from vlite.entrypoints.openai.tool_parsers.json_stream import (CallAssembler, JsonError, JsonLexer, canonical,
                                                               loads, parse_call)

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """A non-empty array of calls, each naming one of the tools with parameters valid for it."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": parameters_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class RequiredToolCallParser(ToolParser):
    """Parses the JSON array written under `required_schema`."""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._top = JsonLexer(self._on)
        self._buf = ""
        self._failed = False
        self._pending = DeltaMessage()

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        try:
            value = loads(model_output.strip())
        except ValueError:
            value = None
        calls = [parse_call(x) for x in value] if isinstance(value, list) else [None]
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(False, [], join_content([model_output]))
        return ExtractedToolCalls(True, [tool_call(*c) for c in calls if c is not None], None)

    def _on(self, kind: str, value: Any, depth: int) -> None:
        if depth == 0:
            if kind == "open" and value == "[" or kind == "close":
                return
            raise JsonError("the calls must be a JSON array")
        if depth == 1 and kind == "comma":
            return
        if depth == 1 and kind == "open":
            self._assembler = CallAssembler(base=1)
            self._name_sent = self._args_sent = False
        assert self._assembler is not None
        self._assembler.on(kind, value, depth)
        self._pending.extend(self._call_deltas(final=self._assembler.closed))

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        if self._failed:
            return DeltaMessage()
        self._buf += delta_text
        try:
            self._top.feed(delta_text)
        except JsonError:
            self._failed = True
            if self.num_calls == 0:
                return self._content(self._buf)
        out, self._pending = self._pending, DeltaMessage()
        return out

    def finish_streaming(self) -> DeltaMessage:
        if self.num_calls == 0 and not self._failed:
            return self._content(self._buf)
        return DeltaMessage()


class NamedToolCallParser(ToolParser):
    """Parses the arguments object written under a named function's parameters schema."""

    def __init__(self, name: str, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.name = name
        self._lexer_args: list[str] = []
        self._lexer = JsonLexer(lambda kind, value, depth: self._lexer_args.append(canonical(kind, value)))
        self._failed = False
        self._sent_any = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        try:
            arguments = parse_call({"name": self.name, "arguments": loads(model_output.strip())})
        except ValueError:
            arguments = None
        args = arguments[1] if arguments is not None else model_output
        return ExtractedToolCalls(True, [tool_call(self.name, args)], None)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        out = DeltaMessage()
        if not self._sent_any:
            self._sent_any = True
            self.num_calls = 1
            out.tool_calls.append({"index": 0, "id": make_tool_call_id(), "type": "function",
                                   "function": {"name": self.name, "arguments": ""}})
        args: Optional[str] = None
        if self._failed:
            args = delta_text
        else:
            try:
                self._lexer.feed(delta_text)
            except JsonError:
                self._failed = True
            args = "".join(self._lexer_args)
            self._lexer_args.clear()
        if args:
            out.tool_calls.append({"index": 0, "function": {"arguments": args}})
        return out

    def finish_streaming(self) -> DeltaMessage:
        if not self._sent_any:
            return self.extract_tool_calls_streaming("")
        if not self._failed:
            try:
                self._lexer.finish()
            except JsonError:
                pass
            if self._lexer_args:
                args = "".join(self._lexer_args)
                return DeltaMessage(tool_calls=[{"index": 0, "function": {"arguments": args}}])
        return DeltaMessage()

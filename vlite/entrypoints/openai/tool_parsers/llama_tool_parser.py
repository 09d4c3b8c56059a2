"""`--tool-call-parser llama3_json`: Llama 3.x's JSON calls, `{"name": ..., "parameters": {...}}` (or
"arguments"), optionally after `<|python_tag|>`, several separated by `;`. An output that does not
start with a call is content; text after the calls is content."""

from __future__ import annotations

from vlite.entrypoints.openai.tool_parsers.abstract_tool_parser import (DeltaMessage, ExtractedToolCalls,
                                                                       ToolParser, join_content, tool_call)
from vlite.entrypoints.openai.tool_parsers.json_stream import DECODER, JsonError, parse_call
from vlite.entrypoints.openai.tool_parsers.registry import ToolParserManager

_WS = " \t\n\r"


@ToolParserManager.register("llama3_json")
class Llama3JsonToolParser(ToolParser):
    TAG = "<|python_tag|>"

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self._buf = ""
        self._state = "start"  # start | calls | text
        self._raw = ""

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        s = model_output.lstrip()
        pos = len(self.TAG) if s.startswith(self.TAG) else 0
        calls = []
        while True:
            while pos < len(s) and s[pos] in _WS:
                pos += 1
            if not s.startswith("{", pos):
                break
            try:
                obj, end = DECODER.raw_decode(s, pos)
            except ValueError:
                break
            parsed = parse_call(obj)
            if parsed is None:
                break
            calls.append(tool_call(*parsed))
            pos = end
            while pos < len(s) and s[pos] in _WS:
                pos += 1
            if s.startswith((";", ","), pos):
                pos += 1
        if not calls:
            return ExtractedToolCalls(False, [], join_content([model_output]))
        return ExtractedToolCalls(True, calls, join_content([s[pos:]]))

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        self._buf += delta_text
        out = DeltaMessage()
        while True:
            if self._state == "start":
                b = self._buf.lstrip()
                after = b[len(self.TAG):].lstrip() if b.startswith(self.TAG) else b
                if not b or (len(b) < len(self.TAG) and self.TAG.startswith(b)) or not after:
                    return out  # not yet known whether this output is a call
                if after.startswith("{"):
                    self._state, self._buf = "calls", after
                else:
                    self._state = "text"
            if self._state == "text":
                out.extend(self._content(self._buf))
                self._buf = ""
                return out
            if self._assembler is None:  # between calls
                b = self._buf.lstrip(_WS + ";,")
                if not b:
                    self._buf = ""
                    return out
                if not b.startswith("{"):
                    self._state, self._buf = "text", b
                    continue
                self._buf, self._raw = b, ""
                self._start_call()
            assert self._lexer is not None
            try:
                delta, used = self._feed_call(self._buf)
            except JsonError:
                if not self._call_emitted():  # not a call: the rest is content
                    self._state, self._buf = "text", self._raw + self._buf
                    self._assembler = self._lexer = None
                    continue
                self._buf = ""  # a broken call already announced: its remainder is dropped
                return out
            out.extend(delta)
            self._raw += self._buf[:used]
            self._buf = self._buf[used:]
            if not self._lexer.done:
                return out
            if self._call_emitted():
                out.extend(self._end_call())
            else:  # a JSON object that is not a call
                self._state, self._buf = "text", self._raw + self._buf
                self._assembler = self._lexer = None

    def finish_streaming(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._state == "calls" and self._assembler is not None:
            out.extend(self._end_call() if self._call_emitted() else self._content(self._raw + self._buf))
        elif self._state == "calls":
            out.extend(self._content(self._buf.lstrip(_WS + ";,")))
        else:
            out.extend(self._content(self._buf))
        self._buf = ""
        return out

"""`--tool-call-parser hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(Hermes 2 Pro's format, used by Qwen 2.5 / Qwen 3 and many fine-tunes). Text outside the blocks is
content; a block whose JSON is not a call stays in the content as it was written."""

from __future__ import annotations

from vlite.entrypoints.openai.tool_parsers.abstract_tool_parser import (DeltaMessage, ExtractedToolCalls,
                                                                       ToolParser, held_prefix, join_content,
                                                                       tool_call)
from vlite.entrypoints.openai.tool_parsers.json_stream import JsonError, loads, parse_call
from vlite.entrypoints.openai.tool_parsers.registry import ToolParserManager


@ToolParserManager.register("hermes")
class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self._buf = ""
        self._in_call = False
        self._raw = ""
        self._broken = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        text, calls, content, pos = model_output, [], [], 0
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:i])
            j = text.find(self.END, i + len(self.START))
            end = j + len(self.END) if j >= 0 else len(text)
            body = text[i + len(self.START):j if j >= 0 else len(text)]
            try:
                parsed = parse_call(loads(body.strip()))
            except ValueError:
                parsed = None
            if parsed is not None:
                calls.append(tool_call(*parsed))
            else:
                content.append(text[i:end])
            pos = end
        return ExtractedToolCalls(bool(calls), calls, join_content(content))

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        self._buf += delta_text
        out = DeltaMessage()
        while True:
            if not self._in_call:
                i = self._buf.find(self.START)
                if i < 0:
                    cut = len(self._buf) - held_prefix(self._buf, self.START)
                    out.extend(self._content(self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    return out
                out.extend(self._content(self._buf[:i]))
                self._buf = self._buf[i + len(self.START):]
                self._in_call, self._raw, self._broken = True, self.START, False
                self._start_call()
            j = self._buf.find(self.END)
            cut = j if j >= 0 else len(self._buf) - held_prefix(self._buf, self.END)
            piece, self._buf = self._buf[:cut], self._buf[cut + (len(self.END) if j >= 0 else 0):]
            self._raw += piece
            if not self._broken:
                try:
                    out.extend(self._feed_call(piece)[0])
                except JsonError:
                    self._broken = True
            if self._broken and not self._call_emitted():
                # Not a tool call after all: what was written is content.
                out.extend(self._content(self._raw + (self.END if j >= 0 else "")))
                self._in_call, self._assembler, self._lexer = False, None, None
                continue
            if j < 0:
                return out
            out.extend(self._close())

    def _close(self) -> DeltaMessage:
        self._in_call = False
        if self._call_emitted():
            return self._end_call()
        self._assembler = self._lexer = None
        return self._content(self._raw + self.END)

    def finish_streaming(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._in_call:
            self._raw += self._buf
            if not self._broken:
                try:
                    out.extend(self._feed_call(self._buf)[0])
                except JsonError:
                    pass
            self._in_call = False
            out.extend(self._end_call() if self._call_emitted() else self._content(self._raw))
        else:
            out.extend(self._content(self._buf))
        self._buf = ""
        return out

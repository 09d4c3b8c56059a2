"""Tool parsers by their `--tool-call-parser` name (vLLM's names)."""

from __future__ import annotations

from typing import Callable


class ToolParserManager:
    tool_parsers: dict[str, type] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[type], type]:
        def add(parser: type) -> type:
            cls.tool_parsers[name] = parser
            return parser
        return add

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        if name not in cls.tool_parsers:
            raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(cls.tool_parsers)}")
        return cls.tool_parsers[name]

"""Tool-call parsers for /v1/chat/completions, one module per model family's format, chosen with
`vlite serve --tool-call-parser NAME`."""

from vlite.entrypoints.openai.tool_parsers.abstract_tool_parser import (DeltaMessage, ExtractedToolCalls,
                                                                       ToolParser)
from vlite.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from vlite.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from vlite.entrypoints.openai.tool_parsers.openai_tool_parser import OpenAIToolParser
from vlite.entrypoints.openai.tool_parsers.registry import ToolParserManager

__all__ = ["DeltaMessage", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "OpenAIToolParser",
           "ToolParser", "ToolParserManager"]

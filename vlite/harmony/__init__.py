"""OpenAI's harmony chat format (gpt-oss): prompts rendered from chat messages and tools, completions read
back into reasoning, content and tool calls. Pure Python, no tokenizer files: the `openai-harmony` package
loads its o200k encoding from the network at run time, which vlite's users may not have."""

from vlite.harmony.parser import (SPECIAL_TOKENS, STOP_TOKENS, HarmonyDelta, HarmonyHeader, HarmonyMessage,
                                  HarmonyParser, ParsedCompletion, collect, parse_completion, prompt_inside)
from vlite.harmony.render import REASONING_EFFORTS, is_harmony_tokenizer, render_chat, stop_token_ids

__all__ = ["REASONING_EFFORTS", "SPECIAL_TOKENS", "STOP_TOKENS", "HarmonyDelta", "HarmonyHeader", "HarmonyMessage",
           "HarmonyParser", "ParsedCompletion", "collect", "is_harmony_tokenizer", "parse_completion", "prompt_inside",
           "render_chat", "stop_token_ids"]

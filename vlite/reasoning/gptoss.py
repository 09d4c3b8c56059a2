"""`--reasoning-parser openai_gptoss` (vLLM's name): gpt-oss writes its thinking in harmony's `analysis`
channel, not between tags. The split is harmony's (vlite.harmony.parser): analysis is the reasoning; the
`final` channel (and a commentary preamble) is the content; tool calls are the `openai` tool parser's.

The engine's view (structured outputs on the answer, a thinking budget) follows tokens: the output is
reasoning from its first token until `<|channel|>final<|message|>`, the header of the answer, which is
also what a thinking budget forces (the parser closes a message cut short by it)."""

from __future__ import annotations

from typing import Any, Optional

from vlite.harmony.parser import CHANNEL, FINAL, MESSAGE, HarmonyParser, collect, prompt_inside
from vlite.reasoning.abs_reasoning_parsers import CONTENT, REASONING, ReasoningDelta, ReasoningParser, \
    ReasoningParserManager


@ReasoningParserManager.register("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    start_str = ""  # no start tag: a harmony completion is reasoning until its answer begins
    end_str = f"{CHANNEL}final{MESSAGE}"
    implicit_start = True

    def __init__(self, tokenizer: Any = None, phase: str = REASONING) -> None:
        super().__init__(tokenizer, phase)
        self._parser = self._new_parser()

    def _new_parser(self) -> HarmonyParser:
        return HarmonyParser(inside=FINAL if self.phase == CONTENT else None)

    @classmethod
    def tag_token_ids(cls, tokenizer: Any) -> tuple[list[int], list[int]]:
        return [], tokenizer.encode(cls.end_str, add_special_tokens=False)

    @classmethod
    def prompt_phase(cls, prompt: str) -> str:
        """In the answer when the prompt left a final message open (continue_final_message), else reasoning."""
        return CONTENT if prompt_inside(prompt) is not None else REASONING

    def extract_reasoning(self, model_output: str) -> tuple[Optional[str], Optional[str]]:
        parser = self._new_parser()
        parsed = collect([parser.feed(model_output), parser.finish()])
        return parsed.reasoning, parsed.content

    def extract_reasoning_streaming(self, delta_text: str) -> ReasoningDelta:
        d = self._parser.feed(delta_text)
        return ReasoningDelta(reasoning=d.reasoning, content=d.content)

    def finish_streaming(self) -> ReasoningDelta:
        d = self._parser.finish()
        return ReasoningDelta(reasoning=d.reasoning, content=d.content)

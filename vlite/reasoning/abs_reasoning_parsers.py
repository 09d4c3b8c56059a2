"""What every reasoning parser provides (vLLM's ReasoningParser), and the registry that names them.

A reasoning model writes its thinking in a block (`<think>` ... `</think>`) before the answer. A parser
splits an output into `reasoning` and `content`, whole (`extract_reasoning`) or as it streams
(`extract_reasoning_streaming` per piece of text, then `finish_streaming`); the streamed pieces add up
to exactly what the whole-output split gives. The output may begin inside the block: the chat template
opened it in the prompt (DeepSeek-R1, newer Qwen3), which `prompt_phase` reads off the prompt's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

from vlite.utils import held_prefix

# Where an output starts (and, streaming, where it is): inside the reasoning block, before it (the output
# may open one: a leading start tag is dropped), or in the answer.
REASONING, PENDING, CONTENT = "reasoning", "pending", "content"


@dataclass
class ReasoningDelta:
    """What one streamed piece of output adds to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)

    def extend(self, other: ReasoningDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


def find_seq(ids: Sequence[int], seq: Sequence[int], last: bool = True) -> int:
    """Index of the last (or first) occurrence of `seq` in `ids`; -1 if none."""
    n = len(seq)
    if not n:
        return -1
    starts = range(len(ids) - n, -1, -1) if last else range(len(ids) - n + 1)
    for i in starts:
        if ids[i] == seq[0] and list(ids[i:i + n]) == list(seq):
            return i
    return -1


class ReasoningParser:
    """Splits one output into reasoning and answer. One instance per choice: the streaming state lives on it.

    `start_str` / `end_str`: the block's tags; `implicit_start`: output before the end tag is reasoning even
    without a start tag (DeepSeek-R1's rule). With a tokenizer, `start_token_ids` / `end_token_ids` are the
    tags' token sequences (what the engine watches: structured outputs, a thinking budget).
    """

    start_str: ClassVar[str] = "<think>"
    end_str: ClassVar[str] = "</think>"
    implicit_start: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None, phase: str = PENDING) -> None:
        self.tokenizer = tokenizer
        if phase not in (REASONING, PENDING, CONTENT):
            raise ValueError(f"phase must be one of {REASONING!r}, {PENDING!r}, {CONTENT!r}, got {phase!r}")
        self.phase = phase
        self._buf = ""

    # ---- tags as tokens ---------------------------------------------------------------------------

    @classmethod
    def tag_token_ids(cls, tokenizer: Any) -> tuple[list[int], list[int]]:
        """The start and end tags' token ids under `tokenizer` (one id each for Qwen3's and R1's tags)."""
        return (tokenizer.encode(cls.start_str, add_special_tokens=False),
                tokenizer.encode(cls.end_str, add_special_tokens=False))

    @property
    def start_token_ids(self) -> list[int]:
        return self.tag_token_ids(self._need_tokenizer())[0]

    @property
    def end_token_ids(self) -> list[int]:
        return self.tag_token_ids(self._need_tokenizer())[1]

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__}: token ids need a tokenizer")
        return self.tokenizer

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` (an output so far) has closed the block: an end tag after the last start tag."""
        start, end = self.tag_token_ids(self._need_tokenizer())
        i = find_seq(token_ids, end)
        return i >= 0 and i > find_seq(token_ids, start)

    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The ids of the answer: those after the last end tag (none while the block is open)."""
        end = self.end_token_ids
        i = find_seq(token_ids, end)
        return list(token_ids[i + len(end):]) if i >= 0 else []

    # ---- where an output starts --------------------------------------------------------------------

    @classmethod
    def prompt_phase(cls, prompt: str) -> str:
        """Where the output of `prompt` starts: inside the block when the prompt ends with an open start tag
        (R1's and newer Qwen3's templates), in the answer when it ends with an end tag (Qwen3's template
        with enable_thinking false writes an empty block), else PENDING (the output may open one)."""
        tail = prompt.rstrip()
        if tail.endswith(cls.start_str):
            return REASONING
        if tail.endswith(cls.end_str):
            return CONTENT
        return PENDING

    @classmethod
    def prompt_phase_of_ids(cls, tokenizer: Any, prompt_token_ids: Sequence[int], tail_tokens: int = 16) -> str:
        """prompt_phase from token ids: only the prompt's last tokens are decoded (the tags sit at its end)."""
        return cls.prompt_phase(tokenizer.decode(list(prompt_token_ids[-tail_tokens:]), skip_special_tokens=False))

    # ---- whole outputs -----------------------------------------------------------------------------

    def extract_reasoning(self, model_output: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole output, each None when empty; the output starts in `self.phase`.
        No end tag: the block never closed (max_tokens), everything after its start is reasoning."""
        text, phase = model_output, self.phase
        if phase == PENDING:
            stripped = text.lstrip()
            if stripped.startswith(self.start_str):
                text, phase = stripped[len(self.start_str):], REASONING
            else:
                phase = REASONING if self.implicit_start else CONTENT
        if phase == CONTENT:
            return None, text or None
        reasoning, tag, content = text.partition(self.end_str)
        return reasoning or None, (content if tag else "") or None

    # ---- streaming ---------------------------------------------------------------------------------

    def extract_reasoning_streaming(self, delta_text: str) -> ReasoningDelta:
        """The reasoning and answer text that `delta_text` completes (a tag's first characters are held
        back until the next piece says whether they are the tag)."""
        self._buf += delta_text
        out = ReasoningDelta()
        if self.phase == PENDING:
            stripped = self._buf.lstrip()
            if stripped.startswith(self.start_str):
                self._buf, self.phase = stripped[len(self.start_str):], REASONING
            elif self.start_str.startswith(stripped):
                return out  # whitespace, or the start tag's beginning: not yet known
            else:
                self.phase = REASONING if self.implicit_start else CONTENT
        if self.phase == REASONING:
            i = self._buf.find(self.end_str)
            if i < 0:
                cut = len(self._buf) - held_prefix(self._buf, self.end_str)
                out.reasoning, self._buf = self._buf[:cut], self._buf[cut:]
                return out
            out.reasoning, self._buf = self._buf[:i], self._buf[i + len(self.end_str):]
            self.phase = CONTENT
        out.content, self._buf = self._buf, ""
        return out

    def finish_streaming(self) -> ReasoningDelta:
        """The end of the output: text held back is what it is (an unfinished tag is text)."""
        text, self._buf = self._buf, ""
        if self.phase == PENDING:
            self.phase = REASONING if self.implicit_start else CONTENT
        return ReasoningDelta(reasoning=text) if self.phase == REASONING else ReasoningDelta(content=text)


class ReasoningParserManager:
    """Reasoning parsers by their `--reasoning-parser` name (vLLM's names)."""

    reasoning_parsers: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        def add(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            cls.reasoning_parsers[name] = parser
            return parser
        return add

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name not in cls.reasoning_parsers:
            raise ValueError(f"reasoning_parser: unknown reasoning parser {name!r}; choose one of "
                             f"{sorted(cls.reasoning_parsers)}")
        return cls.reasoning_parsers[name]

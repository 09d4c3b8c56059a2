"""Reads a gpt-oss completion written in OpenAI's harmony format, whole or as it streams.

A completion is a run of messages (the prompt ends with `<|start|>assistant`, so the first header has no
role of its own):

    <|channel|>analysis<|message|>User asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

Each message's content goes to one of three places, as vLLM's harmony parsers route it: the `analysis`
channel (and messages to built-in tools such as `python`) is the reasoning; a message whose recipient is
`functions.NAME` is a tool call with the content as its arguments; the `final` channel, and a commentary
message without recipient (a preamble, meant for the user), is the content. Several messages of one kind
are joined with a newline.

The parser reads text in which the special tokens are spelled out (decoded with skip_special_tokens
false): feeding the whole text at once or in any pieces gives the same result, because a piece that ends
inside a special token's spelling is held back until the next one says whether it is one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from vlite.utils import held_prefix

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
# The special tokens of o200k_harmony that structure a conversation (harmony docs/format.md, with ids).
SPECIAL_TOKENS = {START: 200006, END: 200007, MESSAGE: 200008, CHANNEL: 200005, CONSTRAIN: 200003,
                  RETURN: 200002, CALL: 200012}
# <|return|> ends the answer, <|call|> a tool call: generation stops on either.
STOP_TOKENS = (RETURN, CALL)
_MARKER = re.compile("|".join(re.escape(m) for m in SPECIAL_TOKENS))
FUNCTIONS = "functions."

REASONING, CONTENT, TOOL_CALL, DROPPED = "reasoning", "content", "tool_call", "dropped"


@dataclass
class HarmonyHeader:
    """What a message's header says: `role [to=R] [<|channel|>C [to=R] [<|constrain|>]T]`."""

    role: str = "assistant"
    channel: Optional[str] = None
    recipient: Optional[str] = None
    content_type: Optional[str] = None

    @classmethod
    def parse(cls, text: str, role: Optional[str] = None) -> HarmonyHeader:
        """A header's text (its special tokens spelled out); `role` when the prompt already wrote it."""
        head, has_channel, rest = text.partition(CHANNEL)
        if not has_channel:  # no channel: a <|constrain|> may follow the role's part
            cut = text.find(CONSTRAIN)
            head, rest = (text, "") if cut < 0 else (text[:cut], text[cut:])
        channel_part, has_constrain, constrain_part = rest.partition(CONSTRAIN)
        head_words = head.split()
        if role is None and head_words and not head_words[0].startswith("to="):
            role = head_words.pop(0)
        header, extra = cls(role=role or "assistant"), []
        for i, word in enumerate(head_words + channel_part.split()):
            if word.startswith("to="):
                header.recipient = word[3:]
            elif has_channel and header.channel is None and i >= len(head_words):
                header.channel = word  # the first word after <|channel|>
            else:
                extra.append(word)
        content_type = constrain_part.strip() if has_constrain else " ".join(extra)
        header.content_type = content_type or None
        return header

    def kind(self) -> str:
        """Where this message's content goes: REASONING, CONTENT, TOOL_CALL or DROPPED."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return TOOL_CALL
        if self.role != "assistant":
            return DROPPED
        if self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return CONTENT
        return REASONING  # analysis, and calls to built-in tools (python, browser.*) made in the thought

    @property
    def function_name(self) -> str:
        assert self.recipient is not None
        return self.recipient[len(FUNCTIONS):]


@dataclass
class HarmonyMessage:
    header: HarmonyHeader
    content: str = ""


@dataclass
class HarmonyDelta:
    """What one piece of a completion adds: reasoning and content text, and tool-call pieces
    `(call index, name, arguments text)` where the name is set on a call's first piece only."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, Optional[str], str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def extend(self, other: HarmonyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)


_EXPECT_START, _HEADER, _BODY = "expect_start", "header", "body"


class HarmonyParser:
    """Splits one completion into messages as its text comes (`feed`), then `finish` at its end.

    `role`: the role the prompt's last `<|start|>` already names (None: the text starts with a `<|start|>`);
    `inside`: the header of the message the prompt left open, whose content the text goes on with.
    Lenient where a model (or a forced token, e.g. a thinking budget's `<|channel|>final<|message|>`) cuts a
    message short: a `<|start|>` or `<|channel|>` inside a message's content closes it and begins the next.
    """

    def __init__(self, role: Optional[str] = "assistant", inside: Optional[HarmonyHeader] = None) -> None:
        self.messages: list[HarmonyMessage] = []
        self.num_calls = 0
        self._state = _HEADER if role is not None else _EXPECT_START
        self._role = role  # the role of the header being read, when the prompt wrote it
        self._buf = ""
        self._header = ""
        self._current: Optional[HarmonyMessage] = None
        self._kind = DROPPED
        self._wrote = {REASONING: False, CONTENT: False}
        if inside is not None:  # the prompt ended inside this message (continue_final_message)
            self._open(inside, HarmonyDelta())

    @property
    def current(self) -> Optional[HarmonyMessage]:
        """The message whose content is being read (None between messages)."""
        return self._current

    def feed(self, text: str) -> HarmonyDelta:
        self._buf += text
        out = HarmonyDelta()
        while self._buf:
            m = _MARKER.search(self._buf)
            if m is None:
                cut = len(self._buf) - max(held_prefix(self._buf, t) for t in SPECIAL_TOKENS)
                self._text(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                return out
            self._text(self._buf[:m.start()], out)
            self._buf = self._buf[m.end():]
            self._marker(m.group(), out)
        return out

    def finish(self) -> HarmonyDelta:
        """The end of the completion: held text is text; an open message ends here (a header never finished
        is dropped)."""
        out = HarmonyDelta()
        text, self._buf = self._buf, ""
        self._text(text, out)
        if self._state == _BODY:
            self._close()
        self._state, self._header = _EXPECT_START, ""
        return out

    # ---- states -----------------------------------------------------------------------------------

    def _text(self, text: str, out: HarmonyDelta) -> None:
        if not text:
            return
        if self._state == _HEADER:
            self._header += text
        elif self._state == _BODY:
            assert self._current is not None
            self._current.content += text
            self._emit(text, out)
        # between messages: stray text (a newline after <|end|>) is not part of any message

    def _marker(self, marker: str, out: HarmonyDelta) -> None:
        if self._state == _BODY:
            if marker in (END, RETURN, CALL, START, CHANNEL):
                self._close()
                self._state = _EXPECT_START
                if marker == CHANNEL:  # a message cut short: the next header goes on from here
                    self._state, self._role, self._header = _HEADER, "assistant", CHANNEL
                elif marker == START:
                    self._state, self._role, self._header = _HEADER, None, ""
            else:  # <|message|> or <|constrain|> inside content: text
                self._text(marker, out)
        elif self._state == _HEADER:
            if marker == MESSAGE:
                header = HarmonyHeader.parse(self._header, self._role)
                self._open(header, out)
            elif marker in (CHANNEL, CONSTRAIN):
                self._header += marker
            elif marker == START:
                self._role, self._header = None, ""
            else:  # a header ended without content: malformed, dropped
                self._state, self._header = _EXPECT_START, ""
        elif marker == START:
            self._state, self._role, self._header = _HEADER, None, ""
        elif marker == CHANNEL:  # a header without <|start|>role: the assistant's
            self._state, self._role, self._header = _HEADER, "assistant", CHANNEL

    def _open(self, header: HarmonyHeader, out: HarmonyDelta) -> None:
        self._state, self._header = _BODY, ""
        self._current = HarmonyMessage(header)
        self._kind = header.kind()
        if self._kind == TOOL_CALL:
            out.calls.append((self.num_calls, header.function_name, ""))
            self.num_calls += 1
        elif self._kind in self._wrote and self._wrote[self._kind]:
            self._emit("\n", out, separator=True)

    def _emit(self, text: str, out: HarmonyDelta, separator: bool = False) -> None:
        if self._kind == REASONING:
            out.reasoning += text
        elif self._kind == CONTENT:
            out.content += text
        elif self._kind == TOOL_CALL:
            out.calls.append((self.num_calls - 1, None, text))
        if self._kind in self._wrote and not separator:
            self._wrote[self._kind] = True

    def _close(self) -> None:
        if self._current is not None:
            self.messages.append(self._current)
        self._current = None


@dataclass
class ParsedCompletion:
    """A whole completion: its reasoning, its content (None when empty) and its tool calls (name, arguments)."""

    reasoning: Optional[str]
    content: Optional[str]
    calls: list[tuple[str, str]]


def collect(deltas: list[HarmonyDelta]) -> ParsedCompletion:
    """The sum of a completion's deltas."""
    total = HarmonyDelta()
    for d in deltas:
        total.extend(d)
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for index, name, piece in total.calls:
        if name is not None:
            names[index] = name
        args.setdefault(index, []).append(piece)
    calls = [(names[i], "".join(args[i])) for i in sorted(names)]
    return ParsedCompletion(total.reasoning or None, total.content or None, calls)


FINAL = HarmonyHeader(channel="final")


def prompt_inside(prompt: str) -> Optional[HarmonyHeader]:
    """The header of the message a prompt leaves open (an assistant answer being continued), else None."""
    last = prompt[prompt.rfind(START):]
    head, opened, body = last.partition(MESSAGE)
    if opened and head == f"{START}assistant{CHANNEL}final" and not any(t in body for t in (END, RETURN, CALL)):
        return FINAL
    return None


def parse_completion(text: str, inside: Optional[HarmonyHeader] = None) -> ParsedCompletion:
    """A whole completion's text, parsed (what the streamed deltas add up to); `inside`: see HarmonyParser."""
    parser = HarmonyParser(inside=inside)
    return collect([parser.feed(text), parser.finish()])

"""Reading tool-call JSON as it is generated.

A resumable JSON lexer (`JsonLexer`) reports each token with its nesting depth; `CallAssembler` follows
one `{"name": ..., "arguments" | "parameters": ...}` object through those tokens and hands out the name
once it is complete and then the arguments as fragments of their canonical text,
`json.dumps(arguments, ensure_ascii=False)`: the fragments of a stream concatenate to exactly the string
a non-streamed response carries. Strings are streamed as they grow (a long argument does not wait for
its closing quote); numbers and literals once they end.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

_WS = " \t\n\r"
_SCALAR = set("0123456789+-.eEtruefalsn")
_SCALAR_START = set("-0123456789tfn")
_SIMPLE_ESCAPES = set('"\\/bfnrt')
_HEX = set("0123456789abcdefABCDEF")

Sink = Callable[[str, Any, int], None]


class JsonError(ValueError):
    pass


def escape(c: str) -> str:
    """One decoded character as json.dumps(..., ensure_ascii=False) writes it inside a string."""
    if c == '"' or c == "\\" or ord(c) < 0x20:
        return json.dumps(c)[1:-1]
    return c


def canonical(kind: str, value: Any) -> str:
    """The canonical text of one lexer token (json.dumps's separators)."""
    if kind in ("open", "close", "str_chars", "scalar"):
        return value
    if kind == "colon":
        return ": "
    if kind == "comma":
        return ", "
    if kind == "key":
        return json.dumps(value, ensure_ascii=False)
    if kind in ("str_start", "str_end"):
        return '"'
    raise AssertionError(kind)


class JsonLexer:
    """Validates one JSON value fed in pieces and reports its tokens to `sink(kind, value, depth)`.

    Kinds: open / close ("{" "[" / "}" "]"), colon, comma, key (an object key, decoded, when complete),
    str_start, str_chars (the canonical text of the characters just decoded), str_end (the whole decoded
    string), scalar (a number or literal in canonical form). `depth` is the number of containers around
    the token (for open: before it is pushed; for close: after it is popped). Invalid JSON raises
    JsonError; `done` is set when the value is complete and `feed` returns how much of its text it used.
    """

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.stack: list[str] = []
        self.expect = "value"  # value | value_or_end | key | key_or_end | colon | comma_or_end
        self.done = False
        self.in_str = False
        self.str_is_key = False
        self.esc: Optional[str] = None
        self.high: Optional[str] = None  # a high surrogate waiting for its pair
        self.chars: list[str] = []
        self.scalar: Optional[str] = None

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.done:
                return i
            if self.in_str:
                self._str_char(ch)
                continue
            if self.scalar is not None:
                if ch in _SCALAR:
                    self.scalar += ch
                    continue
                self._end_scalar()
                if self.done:
                    return i
            if ch in _WS:
                continue
            self._token(ch)
        return len(text)

    def finish(self) -> None:
        """End of input: a number at the top level ends here."""
        if self.scalar is not None and not self.stack:
            self._end_scalar()

    def _token(self, ch: str) -> None:
        exp, depth = self.expect, len(self.stack)
        value_ok = exp in ("value", "value_or_end")
        if ch == '"':
            if value_ok or exp in ("key", "key_or_end"):
                self.in_str, self.str_is_key, self.chars = True, not value_ok, []
                if value_ok:
                    self.sink("str_start", None, depth)
                return
        elif ch in "{[":
            if value_ok:
                self.sink("open", ch, depth)
                self.stack.append(ch)
                self.expect = "key_or_end" if ch == "{" else "value_or_end"
                return
        elif ch in "}]":
            top = self.stack[-1] if self.stack else None
            if (ch == "}" and top == "{" and exp in ("key_or_end", "comma_or_end")) or \
                    (ch == "]" and top == "[" and exp in ("value_or_end", "comma_or_end")):
                self.stack.pop()
                self.sink("close", ch, depth - 1)
                self._value_done()
                return
        elif ch == ":":
            if exp == "colon":
                self.sink("colon", ch, depth)
                self.expect = "value"
                return
        elif ch == ",":
            if exp == "comma_or_end":
                self.sink("comma", ch, depth)
                self.expect = "key" if self.stack[-1] == "{" else "value"
                return
        elif ch in _SCALAR_START and value_ok:
            self.scalar = ch
            return
        raise JsonError(f"unexpected {ch!r} (expected {exp.replace('_', ' ')})")

    def _value_done(self) -> None:
        if self.stack:
            self.expect = "comma_or_end"
        else:
            self.done = True

    def _end_scalar(self) -> None:
        raw, self.scalar = self.scalar, None
        try:
            value = json.loads(raw)
        except ValueError:
            raise JsonError(f"invalid literal {raw!r}") from None
        self.sink("scalar", json.dumps(value), len(self.stack))
        self._value_done()

    def _str_char(self, ch: str) -> None:
        if self.esc is not None:
            self.esc += ch
            if len(self.esc) == 2 and ch != "u":
                if ch not in _SIMPLE_ESCAPES:
                    raise JsonError(f"invalid escape {self.esc!r}")
                c, self.esc = json.loads(f'"{self.esc}"'), None
                self._decoded(c)
            elif len(self.esc) > 2:
                if ch not in _HEX:
                    raise JsonError(f"invalid escape {self.esc!r}")
                if len(self.esc) == 6:
                    cp, self.esc = int(self.esc[2:], 16), None
                    if 0xD800 <= cp < 0xDC00:
                        self._flush_high()
                        self.high = chr(cp)
                    elif 0xDC00 <= cp < 0xE000 and self.high is not None:
                        pair, self.high = self.high + chr(cp), None
                        self._decoded(pair.encode("utf-16", "surrogatepass").decode("utf-16"))
                    else:
                        self._decoded(chr(cp))
            return
        if ch == "\\":
            self.esc = "\\"
        elif ch == '"':
            self._flush_high()
            self.in_str = False
            text = "".join(self.chars)
            if self.str_is_key:
                self.sink("key", text, len(self.stack))
                self.expect = "colon"
            else:
                self.sink("str_end", text, len(self.stack))
                self._value_done()
        else:
            self._decoded(ch)

    def _flush_high(self) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            self._decoded(high, flush=False)

    def _decoded(self, c: str, flush: bool = True) -> None:
        if flush:
            self._flush_high()
        self.chars.append(c)
        if not self.str_is_key:
            self.sink("str_chars", "".join(escape(x) for x in c), len(self.stack))


ARG_KEYS = ("arguments", "parameters")


class CallAssembler:
    """Follows one tool-call object whose "{" sits at depth `base` in the lexer's stream.

    `name` is set when its string is complete; `take_args()` returns the canonical arguments text
    accumulated since the last call. The first of "arguments" / "parameters" is the arguments; other
    keys are ignored. `closed` once the object's "}" is seen.
    """

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.name: Optional[str] = None
        self.key: Optional[str] = None
        self.args_key: Optional[str] = None
        self.args_done = False
        self.closed = False
        self.started = False
        self._args: list[str] = []

    def on(self, kind: str, value: Any, depth: int) -> None:
        inner = self.base + 1
        if depth == self.base:
            if kind == "open" and value == "{" and not self.started:
                self.started = True
                return
            if kind == "close" and value == "}":
                self.closed = True
                return
            raise JsonError("a tool call must be a JSON object")
        if depth == inner and kind in ("key", "colon", "comma"):
            if kind == "key":
                self.key = value
                if value in ARG_KEYS and self.args_key is None:
                    self.args_key = value
            return
        if self.key == "name" and depth == inner:
            if kind in ("open", "scalar"):
                raise JsonError("a tool call's name must be a string")
            if kind == "str_end":
                self.name = value
        elif self.key is not None and self.key == self.args_key and not self.args_done:
            self._args.append(canonical(kind, value))
            if depth == inner and kind in ("close", "str_end", "scalar"):
                self.args_done = True

    def take_args(self) -> str:
        out = "".join(self._args)
        self._args.clear()
        return out


def parse_call(obj: Any) -> Optional[tuple[str, str]]:
    """(name, canonical arguments) of a parsed tool-call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in obj if k in ARG_KEYS), None)
    args = obj[key] if key is not None else {}
    return obj["name"], json.dumps(args, ensure_ascii=False)


DECODER = json.JSONDecoder(strict=False)


def loads(text: str) -> Any:
    """json.loads allowing raw control characters inside strings (as the streaming lexer does)."""
    return DECODER.decode(text)

"""`vlite chat`: an interactive multi-turn chat in the terminal, on the model's chat template."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Optional

from vlite.entrypoints.cli.args import add_common_args, add_engine_args, add_sampling_args, sampling_params
from vlite.entrypoints.cli.engine import EXIT_INTERRUPTED, load_engine, stream_request


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat", help="chat with the model in the terminal",
        description="An interactive multi-turn chat using the model's chat template. Type /reset to clear the "
                    "history, /exit or /quit (or Ctrl-D) to leave. Reads one user message per line; works with "
                    "piped input too.")
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system message starting the conversation")
    add_sampling_args(parser, max_tokens=512, temperature=0.7)
    add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_chat)


class ChatSession:
    """The conversation so far and how to turn it into a prompt that fits max_model_len."""

    def __init__(self, tokenizer: Any, max_model_len: int, max_tokens: int, system: Optional[str]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _encode(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_for(self, user_text: str) -> tuple[dict[str, Any], int]:
        """Add the user message; the prompt for the reply, and how many old turns were dropped to fit.

        Keeps room for `max_tokens` of reply where it can by dropping the oldest turns (never the
        system message); raises ValueError, with the message not added, when even the system message
        plus this one leave no room for a reply.
        """
        first = 1 if self.system else 0
        messages = self.messages + [{"role": "user", "content": user_text}]
        dropped = 0
        text, ids = self._encode(messages)
        while len(ids) + self.max_tokens > self.max_model_len and len(messages) - first > 1:
            # Drop the oldest turn: a user message and the reply that followed it.
            cut = 2 if len(messages) - first > 2 and messages[first + 1]["role"] == "assistant" else 1
            del messages[first:first + cut]
            dropped += 1
            text, ids = self._encode(messages)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"this message is too long: the prompt is {len(ids)} tokens, max_model_len is "
                             f"{self.max_model_len}")
        self.messages = messages
        return {"prompt": text, "prompt_token_ids": ids}, dropped

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def drop_last_user(self) -> None:
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()


def _read_lines(interactive: bool) -> Iterator[str]:
    """User lines; ends on EOF. Interactive: with a `>>> ` prompt and line editing."""
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        while True:
            try:
                yield input(">>> ")
            except EOFError:
                print(file=sys.stdout, flush=True)
                return
    else:
        for line in sys.stdin:
            yield line.rstrip("\r\n")


def run_chat(ns: argparse.Namespace) -> int:
    params = sampling_params(ns)  # validate before the slow load
    engine = load_engine(ns)
    tokenizer = engine.get_tokenizer()
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; give one with --chat-template")
    session = ChatSession(tokenizer, engine.max_model_len, ns.max_tokens, ns.system)
    interactive = sys.stdin.isatty()
    if interactive:
        print("Type a message; /reset clears the history, /exit or Ctrl-D leaves.", file=sys.stderr)
    turn = 0
    try:
        for line in _read_lines(interactive):
            command = line.strip()
            if not command:
                continue
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                session.reset()
                print("(history cleared)", file=sys.stderr, flush=True)
                continue
            try:
                prompt, dropped = session.prompt_for(line)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                continue
            if dropped:
                print(f"(dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to fit max_model_len "
                      f"{session.max_model_len})", file=sys.stderr, flush=True)
            reply, finish_reason = stream_request(engine, f"chat-{turn}", prompt, params)
            turn += 1
            sys.stdout.write("\n")
            sys.stdout.flush()
            if finish_reason == "abort":
                session.drop_last_user()
                print("(interrupted)", file=sys.stderr, flush=True)
            else:
                session.add_reply(reply)
    except KeyboardInterrupt:  # Ctrl-C at the prompt
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0

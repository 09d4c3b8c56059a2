"""Helpers of the command-line tests: parsing without running, a fake engine and tokenizer, `python -m vlite`."""

from __future__ import annotations

import argparse
import subprocess
import sys

from vlite.entrypoints.cli import build_parser
from vlite.outputs import CompletionOutput, RequestOutput
from vlite.sampling_params import RequestOutputKind

GREEDY_FLAGS = ["--dtype", "float32", "--max-tokens", "8", "--temperature", "0"]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def run_vlite(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlite", *argv], input=stdin, capture_output=True, text=True,
                          timeout=600)


class FakeTokenizer:
    """Chat template `role: content` lines; one token per whitespace-separated word."""

    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text.split())))


class FakeEngine:
    """Replies to each request with `reply_words`, one word (a DELTA) per step."""

    def __init__(self, reply_words=("hello", " there"), max_model_len=1000, on_step=None):
        self.reply_words = list(reply_words)
        self.max_model_len = max_model_len
        self.on_step = on_step
        self.prompts: list = []
        self.active: dict[str, int] = {}
        self.pending: list[RequestOutput] = []
        self.steps = 0

    def get_tokenizer(self):
        return FakeTokenizer()

    def add_request(self, request_id, prompt, params):
        assert params.output_kind == RequestOutputKind.DELTA
        self.prompts.append(prompt)
        self.active[request_id] = 0

    def abort_request(self, request_id):
        del self.active[request_id]
        self.pending.append(RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], finish_reason="abort")],
                                          finished=True))

    def has_unfinished_requests(self):
        return bool(self.active or self.pending)

    def step(self):
        self.steps += 1
        if self.on_step:
            self.on_step(self)
        outputs, self.pending = self.pending, []
        for rid, i in list(self.active.items()):
            done = i + 1 == len(self.reply_words)
            outputs.append(RequestOutput(rid, None, [], [CompletionOutput(0, self.reply_words[i], [i],
                                                                          finish_reason="stop" if done else None)],
                                         finished=done))
            if done:
                del self.active[rid]
            else:
                self.active[rid] = i + 1
        return outputs

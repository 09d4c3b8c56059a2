"""`vlite generate PROMPT`: complete one prompt (no chat template), streaming the text to stdout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vlite.entrypoints.cli.args import add_common_args, add_engine_args, add_sampling_args, sampling_params
from vlite.entrypoints.cli.engine import EXIT_INTERRUPTED, load_engine, stream_request


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="complete one prompt, streaming the text",
        description="Complete a prompt (raw text, no chat template) and stream the generated text to stdout.")
    parser.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    add_sampling_args(parser, max_tokens=256, temperature=1.0)
    add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    prompt = sys.stdin.read().rstrip("\n") if ns.prompt == "-" else ns.prompt
    if not prompt:
        raise ValueError("prompt must not be empty")
    params = sampling_params(ns)  # validate before the slow load
    engine = load_engine(ns)
    _, finish_reason = stream_request(engine, "generate-0", prompt, params)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return EXIT_INTERRUPTED if finish_reason == "abort" else 0

"""Running an engine from a command: library chatter off, the engine loaded from the flags, one
request streamed to the terminal with Ctrl-C between steps; the exit statuses of every command."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any, Callable, Optional

from vlite.entrypoints.cli.args import engine_args_from_cli
from vlite.sampling_params import SamplingParams

EXIT_USAGE = 2  # argparse's status for bad arguments; used for every user error
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def configure_quiet(verbose: bool) -> None:
    """Library chatter off (unless verbose); call before the model loads."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("vlite").setLevel(logging.INFO)
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("vlite").setLevel(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    # In case transformers / huggingface_hub were imported before the environment was set.
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def load_engine(ns: argparse.Namespace) -> Any:
    """The `LLMEngine` of the engine flags in `ns`, loaded quietly unless `--verbose`."""
    from vlite.engine.llm_engine import LLMEngine

    engine_args = engine_args_from_cli(ns)
    configure_quiet(getattr(ns, "verbose", False))
    if sys.stderr.isatty():
        print("loading model...", file=sys.stderr, flush=True)
    return LLMEngine.from_engine_args(engine_args)


@contextlib.contextmanager
def _deferred_sigint() -> Iterator[Callable[[], bool]]:
    """Turn Ctrl-C into a flag checked between engine steps, so a step is never cut in half.

    Yields a function that says whether Ctrl-C was pressed. A second Ctrl-C raises at once.
    """
    pressed = [False]

    def handler(signum: int, frame: Any) -> None:
        if pressed[0]:
            raise KeyboardInterrupt
        pressed[0] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: leave Ctrl-C alone
        yield lambda: False
        return
    try:
        yield lambda: pressed[0]
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_request(engine: Any, request_id: str, prompt: Any, params: SamplingParams,
                   out: Any = None) -> tuple[str, Optional[str]]:
    """Run one request, writing each text delta to `out` as it arrives (flushing each time).

    Returns the whole generated text and the finish reason ("abort" after Ctrl-C).
    """
    out = out if out is not None else sys.stdout
    pieces: list[str] = []
    finish_reason: Optional[str] = None
    with _deferred_sigint() as interrupted:
        engine.add_request(request_id, prompt, params)
        aborted = False
        while engine.has_unfinished_requests():
            if interrupted() and not aborted:
                engine.abort_request(request_id)
                aborted = True
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                completion = output.outputs[0]
                if completion.text and not aborted:
                    pieces.append(completion.text)
                    out.write(completion.text)
                    out.flush()
                if output.finished:
                    finish_reason = completion.finish_reason
    if aborted:
        finish_reason = "abort"
    return "".join(pieces), finish_reason

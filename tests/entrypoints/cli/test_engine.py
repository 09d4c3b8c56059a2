"""`vlite.entrypoints.cli.engine`: one request streamed to the terminal, Ctrl-C between steps (a fake engine)."""

from __future__ import annotations

import io
import os
import signal

from tests.entrypoints.cli.utils import FakeEngine
from vlite.entrypoints.cli.engine import stream_request
from vlite.sampling_params import RequestOutputKind, SamplingParams


def test_stream_request_writes_each_delta():
    engine = FakeEngine(["a", "b", "c"])
    out = io.StringIO()
    text, reason = stream_request(engine, "r", "prompt", SamplingParams(output_kind=RequestOutputKind.DELTA), out)
    assert (text, reason, out.getvalue()) == ("abc", "stop", "abc")


def test_ctrl_c_aborts_the_request_between_steps():
    def interrupt_on_second_step(engine):
        if engine.steps == 2:
            os.kill(os.getpid(), signal.SIGINT)

    engine = FakeEngine(["a", "b", "c", "d", "e"], on_step=interrupt_on_second_step)
    out = io.StringIO()
    before = signal.getsignal(signal.SIGINT)
    text, reason = stream_request(engine, "r", "p", SamplingParams(output_kind=RequestOutputKind.DELTA), out)
    assert reason == "abort"
    assert text == out.getvalue() and text in ("ab", "abc")  # the step under way completes, then the abort
    assert not engine.has_unfinished_requests()
    assert signal.getsignal(signal.SIGINT) is before

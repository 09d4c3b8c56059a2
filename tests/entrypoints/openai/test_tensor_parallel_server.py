"""`vlite serve --tensor-parallel-size 2`: a model worker killed mid-stream fails the in-flight
request with an error event, /health turns 503 within a second, and no process is left behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from benchmarks.soak import engine_core_pids
from tests.entrypoints.openai.conftest import pid_alive, start_server, wait_unhealthy

pytestmark = pytest.mark.slow


def test_worker_death_fails_requests_and_turns_unhealthy(tmp_path_factory):
    srv = start_server(tmp_path_factory, "--tensor-parallel-size", "2", "--max-num-seqs", "4")
    try:
        engine_pid = srv.engine_pid()
        workers = engine_core_pids(engine_pid)  # the engine core's spawned children: its two workers
        assert len(workers) == 2, workers
        body = {"prompt": "A long story:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(workers[1], signal.SIGKILL)
            t0 = time.time()
            rest = list(lines)  # must end (with an error event), not hang on a collective
        assert any('"error"' in line and "worker" in line for line in rest), rest[-3:]
        status = wait_unhealthy(srv, poll_s=0.05)
        print(f"/health {status} {time.time() - t0:.3f}s after the kill")
        assert status != 200 and time.time() - t0 < 1.0, (status, time.time() - t0)
        assert srv.proc.wait(30) != 0  # the server exits non-zero so a supervisor restarts it
        deadline = time.time() + 5
        while any(pid_alive(p) for p in [engine_pid, *workers]) and time.time() < deadline:
            time.sleep(0.1)
        assert not [p for p in [engine_pid, *workers] if pid_alive(p)], "a process was left behind"
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)

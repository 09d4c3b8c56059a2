"""A real `vlite serve` process on the default model, shared by the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import httpx
import pytest

from benchmarks.soak import child_pids, engine_core_pids

API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    api_key: str
    log_path: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def engine_pid(self) -> int:
        kids = engine_core_pids(self.proc.pid)
        assert len(kids) == 1, f"expected one engine-core child process, found {kids}"
        return kids[0]

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        return out


def start_server(tmp_path_factory, *extra: str, env: Optional[dict[str, str]] = None) -> Server:
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("server") / "server.log")
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "vlite", "serve", "--dtype", "float32", "--port", str(port), "--api-key", API_KEY,
           "--uvicorn-log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {open(log_path).read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Server(proc, url, API_KEY, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in time")


def wait_unhealthy(server: Server, timeout: float = 5.0, poll_s: float = 0.1) -> Optional[int]:
    """Poll /health until it is not 200 (or `timeout`): the last status, None once the server is gone."""
    deadline = time.time() + timeout
    status: Optional[int] = 200
    while time.time() < deadline:
        try:
            status = httpx.get(f"{server.url}/health", timeout=1).status_code
        except httpx.HTTPError:
            status = None  # the server is already gone
        if status != 200:
            break
        time.sleep(poll_s)
    return status


def stop_server(server: Server, timeout: float = 30) -> int:
    engine = child_pids(server.proc.pid)
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        raise
    deadline = time.time() + 10
    while any(pid_alive(p) for p in engine) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in engine), "orphan engine-core process after shutdown"
    return code


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "--trust-request-chat-template")  # the sandbox is under test
    yield srv
    code = stop_server(srv)
    assert code == 0, open(srv.log_path).read()[-3000:]

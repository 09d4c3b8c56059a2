"""Soak a running `vlite serve`: concurrent clients, mixed traffic, random disconnects; then check for leaks.

    python benchmarks/soak.py --url http://127.0.0.1:8000 --api-key KEY --duration 120 --concurrency 8

Each client loops until the time (or the request budget) is up, sending completions or chat requests,
streaming or not, with small max_tokens. Some streams are dropped mid-way (the client closes the
connection), some non-streaming calls are abandoned (cancelled before the answer comes) and about
one request in ten is deliberately invalid. Every request is tracked to one outcome; a request the
server admitted must end with exactly one final answer (each choice with one finish_reason, a
stream with one `[DONE]`) or an error in OpenAI's shape, within a per-request timeout. Afterwards it
polls /metrics until no request is running or waiting and the KV cache is empty, and compares the
resident memory of the API process and its engine-core child before and after.

tests/entrypoints/openai/test_abuse.py runs a short version of this in the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "List three fruits:",
           "The weather today is", "1, 2, 3, 4,", "Translate to French: good morning", "A haiku about the sea:"]

# Requests that must get a 4xx naming the field (mixed into the traffic).
BAD_COMPLETIONS = [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": [1, 2, 10**9]}, None),
    ({"prompt": "hi", "stop": ["x"] * 100}, "stop"),
    ({"prompt": "hi", "seed": 2**80}, "seed"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 5}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% if %}"}, "chat_template"),
]


# ---- process and metrics helpers (also used by the tests) -----------------------------------------

def rss_bytes(pid: int) -> Optional[int]:
    """Resident set size of a process, from /proc (None if it is gone or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def engine_core_pids(api_pid: int) -> list[int]:
    """The API process's children that run the engine core (not multiprocessing's resource tracker)."""
    out = []
    for kid in child_pids(api_pid):
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(kid)
    return out


def find_server_pid(port: int) -> Optional[int]:
    """The `vlite serve` process listening on `port`, found by its command line (best effort)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "serve" not in args or not any("vlite" in a for a in args):
            continue
        wanted = str(port)
        given = args[args.index("--port") + 1] if "--port" in args[:-1] else "8000"
        if given == wanted:
            return int(entry)
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over labels} (histogram buckets left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


async def wait_drained(client: httpx.AsyncClient, url: str, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the KV cache is empty; return the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics((await client.get(f"{url}/metrics", timeout=10)).text)
        if is_drained(m) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.2)


def is_drained(m: dict[str, float]) -> bool:
    return (m.get("vllm:num_requests_running", -1) == 0 and m.get("vllm:num_requests_waiting", -1) == 0
            and m.get("vllm:kv_cache_usage_perc", -1) == 0)


def error_shape_problem(body: Any) -> Optional[str]:
    """None if `body` is OpenAI's error shape, else what is wrong with it."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"not an error object: {str(body)[:200]}"
    err = body["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return f"bad message/type: {err}"
    return None


# ---- the soak ------------------------------------------------------------------------------------

@dataclass
class SoakReport:
    sent: int = 0
    completed: int = 0  # final answer received and well formed
    bad_input_rejected: int = 0  # deliberately invalid requests answered 4xx in OpenAI's shape
    disconnects: int = 0  # streams the client dropped mid-way
    abandoned: int = 0  # non-streaming calls the client cancelled before the answer
    overloaded: int = 0  # 503 with Retry-After (admission control)
    errors: int = 0  # unexpected error answers (4xx on a valid request, error events in a stream)
    server_errors: int = 0  # 5xx other than a 503 with Retry-After
    hangs: int = 0  # no answer within the per-request timeout
    problems: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)  # of completed requests
    duration_s: float = 0.0
    drained: bool = False
    metrics_end: dict[str, float] = field(default_factory=dict)
    rss_start: dict[str, Optional[int]] = field(default_factory=dict)
    rss_end: dict[str, Optional[int]] = field(default_factory=dict)

    def _latency(self) -> str:
        if not self.latencies_s:
            return "n/a"
        xs = sorted(self.latencies_s)
        p95 = xs[min(len(xs) - 1, int(len(xs) * 0.95))]
        return f"p50 {xs[len(xs) // 2]:.2f} s, p95 {p95:.2f} s, max {xs[-1]:.2f} s"

    def problem(self, what: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(what)

    @property
    def ok(self) -> bool:
        return not self.problems and self.server_errors == 0 and self.hangs == 0 and self.errors == 0 \
            and self.drained

    def summary(self) -> str:
        def mb(x: Optional[int]) -> str:
            return "n/a" if x is None else f"{x / 2**20:.0f} MB"

        lines = [f"duration            {self.duration_s:.1f} s",
                 f"requests sent       {self.sent}",
                 f"completed           {self.completed}",
                 f"bad input -> 4xx    {self.bad_input_rejected}",
                 f"disconnects         {self.disconnects} (streams dropped mid-way)",
                 f"abandoned           {self.abandoned} (non-streaming calls cancelled)",
                 f"overloaded (503)    {self.overloaded}",
                 f"unexpected errors   {self.errors}",
                 f"5xx                 {self.server_errors}",
                 f"hangs               {self.hangs}",
                 f"latency (completed) {self._latency()}",
                 f"drained             {self.drained} (running "
                 f"{self.metrics_end.get('vllm:num_requests_running')}, waiting "
                 f"{self.metrics_end.get('vllm:num_requests_waiting')}, kv_cache_usage_perc "
                 f"{self.metrics_end.get('vllm:kv_cache_usage_perc')})"]
        for proc in self.rss_start:
            lines.append(f"RSS {proc:<15} {mb(self.rss_start[proc])} -> {mb(self.rss_end.get(proc))}")
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


def _rss(api_pid: Optional[int]) -> dict[str, Optional[int]]:
    if api_pid is None:
        return {}
    engines = engine_core_pids(api_pid)
    return {"api": rss_bytes(api_pid), "engine-core": rss_bytes(engines[0]) if engines else None}


def _body(rng: random.Random, chat: bool, stream: bool) -> dict[str, Any]:
    prompt = f"{rng.choice(PROMPTS)} ({rng.randrange(10**6)})"
    body: dict[str, Any] = {"max_tokens": rng.randint(2, 16), "stream": stream,
                            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.2:
        body["stop"] = [".", "\n"]
    if rng.random() < 0.2:
        if chat:
            body.update(logprobs=True, top_logprobs=2)
        else:
            body["logprobs"] = 2
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return body


class _Client:
    def __init__(self, http: httpx.AsyncClient, url: str, report: SoakReport, rng: random.Random,
                 request_timeout: float) -> None:
        self.http, self.url, self.report, self.rng, self.timeout = http, url, report, rng, request_timeout
        self.t0 = time.monotonic()

    async def one(self) -> None:
        rng, report = self.rng, self.report
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        report.sent += 1
        if rng.random() < 0.1:
            body, param = rng.choice(BAD_CHATS if chat else BAD_COMPLETIONS)
            await self._bad(path, body, param)
            return
        stream = rng.random() < 0.5
        body = _body(rng, chat, stream)
        action = rng.random()
        self.t0 = time.monotonic()
        try:
            if stream:
                drop_after = rng.randint(1, 4) if action < 0.25 else None
                await asyncio.wait_for(self._stream(path, body, chat, drop_after), self.timeout)
            elif action < 0.2:
                await self._abandon(path, body, chat, rng.uniform(0.02, 1.0))
            else:
                r = await asyncio.wait_for(self.http.post(f"{self.url}{path}", json=body), self.timeout)
                self._check_full(r, body, chat)
        except asyncio.TimeoutError:
            report.hangs += 1
            report.problem(f"no answer within {self.timeout} s: {path} {json.dumps(body)[:200]}")
        except httpx.HTTPError as e:
            report.errors += 1
            report.problem(f"transport error {type(e).__name__}: {e} on {path}")

    def _status_problem(self, r: httpx.Response, what: str) -> bool:
        """Count a non-200 answer; True if there was one."""
        report = self.report
        if r.status_code == 200:
            return False
        try:
            body = r.json()
        except ValueError:
            body = r.text
        if r.status_code == 503 and "retry-after" in r.headers:
            report.overloaded += 1
        elif r.status_code >= 500:
            report.server_errors += 1
            report.problem(f"{r.status_code} on {what}: {str(body)[:300]}")
        else:
            report.errors += 1
            report.problem(f"{r.status_code} on a valid request {what}: {str(body)[:300]}")
        shape = error_shape_problem(body)
        if shape:
            report.problem(f"{r.status_code} body not in OpenAI's shape ({shape})")
        return True

    async def _bad(self, path: str, body: dict[str, Any], param: Optional[str]) -> None:
        r = await asyncio.wait_for(self.http.post(f"{self.url}{path}", json=body), self.timeout)
        report = self.report
        if r.status_code >= 500:
            report.server_errors += 1
            report.problem(f"{r.status_code} on bad input {json.dumps(body)[:200]}: {r.text[:200]}")
        elif not 400 <= r.status_code < 500:
            report.problem(f"bad input {json.dumps(body)[:200]} answered {r.status_code}")
        else:
            shape = error_shape_problem(r.json())
            if shape:
                report.problem(f"bad input: error body not in OpenAI's shape ({shape})")
            elif param is not None and r.json()["error"]["param"] != param:
                report.problem(f"bad input {json.dumps(body)[:100]}: param {r.json()['error']['param']!r}, "
                               f"expected {param!r}")
            else:
                report.bad_input_rejected += 1

    def _check_full(self, r: httpx.Response, body: dict[str, Any], chat: bool) -> None:
        if self._status_problem(r, f"{'chat' if chat else 'completion'} request"):
            return
        data = r.json()
        n_expected = body.get("n", 1)
        finishes = [c.get("finish_reason") for c in data.get("choices", [])]
        if len(finishes) != n_expected or not all(finishes):
            self.report.problem(f"incomplete answer: {len(finishes)} choices, finish reasons {finishes}")
            return
        self.report.completed += 1
        self.report.latencies_s.append(time.monotonic() - self.t0)

    async def _stream(self, path: str, body: dict[str, Any], chat: bool, drop_after: Optional[int]) -> None:
        report = self.report
        finishes: dict[int, int] = {}
        done = 0
        events = 0
        async with self.http.stream("POST", f"{self.url}{path}", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self._status_problem(r, "stream")
                return
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    report.problem(f"stream line not SSE: {line[:100]}")
                    continue
                payload = line[len("data: "):]
                events += 1
                if payload == "[DONE]":
                    done += 1
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    code = chunk["error"].get("code")
                    if isinstance(code, int) and code >= 500:
                        report.server_errors += 1
                    else:
                        report.errors += 1
                    report.problem(f"error event in stream: {payload[:300]}")
                for c in chunk.get("choices", []):
                    if c.get("finish_reason"):
                        finishes[c["index"]] = finishes.get(c["index"], 0) + 1
                if drop_after is not None and events >= drop_after:
                    report.disconnects += 1
                    return  # leaving the `async with` closes the connection mid-stream
        n_expected = body.get("n", 1)
        if done != 1 or sorted(finishes) != list(range(n_expected)) or any(v != 1 for v in finishes.values()):
            report.problem(f"stream ended badly: [DONE] x{done}, finish reasons per choice {finishes}, "
                           f"n={n_expected}")
            return
        report.completed += 1
        report.latencies_s.append(time.monotonic() - self.t0)

    async def _abandon(self, path: str, body: dict[str, Any], chat: bool, after: float) -> None:
        task = asyncio.ensure_future(self.http.post(f"{self.url}{path}", json=body))
        done, _ = await asyncio.wait({task}, timeout=after)
        if task in done:  # it finished first: check it like any other answer
            self._check_full(task.result(), body, chat)
            return
        task.cancel()  # closes the connection; the server aborts the request
        await asyncio.gather(task, return_exceptions=True)
        self.report.abandoned += 1


async def soak(url: str, api_key: Optional[str], duration: float, concurrency: int, max_requests: int = 10**9,
               api_pid: Optional[int] = None, seed: int = 0, request_timeout: float = 120.0,
               drain_timeout: float = 30.0, min_requests_per_client: int = 0) -> SoakReport:
    """Run the soak. Each client's sequence of requests is fixed by `seed`; it sends until `duration`
    is up, but at least `min_requests_per_client` (so a slow machine still covers the same cases)."""
    report = SoakReport()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(headers=headers, timeout=request_timeout, limits=limits) as http:
        report.rss_start = _rss(api_pid)
        start = time.monotonic()
        deadline = start + duration

        async def worker(i: int) -> None:
            client = _Client(http, url, report, random.Random(seed * 1000 + i), request_timeout)
            sent = 0
            while (time.monotonic() < deadline or sent < min_requests_per_client) and report.sent < max_requests:
                await client.one()
                sent += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        report.duration_s = time.monotonic() - start
        report.metrics_end = await wait_drained(http, url, drain_timeout)
        report.drained = is_drained(report.metrics_end)
        report.rss_end = _rss(api_pid)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("VLITE_API_KEY"))
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    parser.add_argument("--max-requests", type=int, default=10**9, help="stop after this many requests")
    parser.add_argument("--pid", type=int, default=None,
                        help="the server's (API process) pid, for RSS; found from the port when left out")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    pid = args.pid or find_server_pid(httpx.URL(args.url).port or 80)
    report = asyncio.run(soak(args.url, args.api_key, args.duration, args.concurrency, args.max_requests, pid,
                              args.seed, args.request_timeout))
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

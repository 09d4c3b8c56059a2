"""`vlite bench serve`: online serving benchmark against a running `vlite serve` (or any OpenAI-compatible server).

The output follows `vllm bench serve`. Requests (random token-id prompts as in `vlite bench throughput`,
or `--dataset-path`) are sent to `/v1/completions` (or `/v1/chat/completions`) with `stream: true`,
`stream_options: {"include_usage": true}`, `max_tokens` = the request's output length and `ignore_eos:
true`, so every request generates exactly its output length. Arrivals: `--request-rate R` requests/s
as a Poisson process (exponential gaps, seeded; `--burstiness` other than 1 gives gamma-distributed
gaps of the same mean), or all at once (`inf`, the default); `--max-concurrency N` caps the requests
in flight (the rest wait, and their clock starts when they are sent).

Per request, timed on the client from the moment it is sent:

    TTFT     time to the first content chunk (a choice with text, or its finish_reason)
    ITL      the gaps between consecutive content chunks (one token each, unless the server merges)
    TPOT     (E2E - TTFT) / (output tokens - 1): mean time per output token after the first
    E2E      time until the stream ended (`data: [DONE]`)
    output tokens   `usage.completion_tokens` of the final usage chunk (else: the content chunks)

A request fails on a non-200 answer, an error event in the stream, a stream that ends before
`data: [DONE]`, or a transport error; failed requests count in no metric but "Failed requests".
Throughputs are over the benchmark duration: from the first request's scheduled send to the last
request's end.

Random prompts need the served model's vocabulary; the tokenizer is loaded (fast, cached, no model
weights) when it is known: `--tokenizer`, else the served model when it is the bundled default model
or a local path. Otherwise the ids are drawn from `FALLBACK_TOKEN_IDS` (1000..29999), a range that holds
ordinary (non-special) tokens in common vocabularies (SmolLM2, Llama, Qwen, Mistral, GPT-2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from vlite.benchmarks.datasets import (BenchRequest, load_json_dataset, random_requests, summarize,
                                       tokenizer_special_ids)
from vlite.benchmarks.utils import add_dataset_args, jsonable_args, percentile, spec_decoding_report, write_json
from vlite.entrypoints.cli.args import non_negative_float, parse_number, positive_float, positive_int

HELP = "online serving against a running `vlite serve`: TTFT, TPOT, ITL, E2E and throughput under load"
DESCRIPTION = ("Online serving benchmark (after `vllm bench serve`): streams requests to a running OpenAI-compatible "
               "server (`vlite serve`) at --request-rate requests/s (Poisson arrivals; inf = all at once), at most "
               "--max-concurrency in flight, and reports request and token throughput and the mean, median, p90 "
               "and p99 of time to first token, time per output token, inter-token latency and end-to-end "
               "latency. Random token-id prompts (as `vlite bench throughput`) or --dataset-path.")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 64
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
FALLBACK_TOKEN_IDS = range(1000, 30000)
DEFAULT_PERCENTILES = (90.0, 99.0)
METRICS = (("ttft", "Time to First Token", "TTFT"),
           ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"),
           ("e2el", "End-to-end Latency", "E2EL"))


# --------------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------------

def request_rate(text: str) -> float:
    """A positive number of requests/s, or inf."""
    value = parse_number(text, float, "rate", "; a number of requests/s or inf")
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def percentile_list(text: str) -> tuple[float, ...]:
    """Comma-separated percentiles, each in (0, 100)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid percentiles {text!r}; e.g. 90,99") from None
    if not values or not all(0 < v < 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100), got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument("--base-url", default=DEFAULT_BASE_URL, metavar="URL",
                       help="the server's address (default: %(default)s)")
    group.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS,
                       help="the API route to benchmark (default: %(default)s); chat requests send the random "
                            "prompts as text (decoded by the tokenizer or the server's /detokenize)")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="sent as `Authorization: Bearer KEY` (default: $VLITE_API_KEY, else $OPENAI_API_KEY)")
    group.add_argument("--model", default=None, metavar="NAME",
                       help="the `model` field of the requests (default: the first id of the server's /v1/models)")
    group.add_argument("--tokenizer", default=None, metavar="MODEL",
                       help="where the random prompts' vocabulary comes from: a model path or repo id, as `vlite "
                            "serve` takes (default: the served model if it is the bundled default or a local path, "
                            f"else token ids {FALLBACK_TOKEN_IDS.start}..{FALLBACK_TOKEN_IDS.stop - 1})")
    group.add_argument("--request-timeout", type=positive_float, default=600.0, metavar="S",
                       help="give up on a request after S seconds without progress (default: %(default)s)")
    group.add_argument("--ready-timeout", type=non_negative_float, default=0.0, metavar="S",
                       help="wait up to S seconds for the server to answer /v1/models (e.g. while it loads the "
                            "model); 0: fail at once (default: %(default)s)")
    group = add_dataset_args(parser, DEFAULT_NUM_PROMPTS)
    group.add_argument("--seed", type=int, default=0, metavar="SEED",
                       help="seed of the random prompts and of the arrival times (default: %(default)s)")
    group = parser.add_argument_group("traffic options")
    group.add_argument("--request-rate", type=request_rate, default=math.inf, metavar="R",
                       help="requests per second, arriving as a Poisson process; inf sends them all at once "
                            "(default: %(default)s)")
    group.add_argument("--burstiness", type=positive_float, default=1.0, metavar="B",
                       help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, below 1 "
                            "burstier, above 1 more even (default: %(default)s)")
    group.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                       help="most requests in flight at once; others wait to be sent (default: no limit)")
    group = parser.add_argument_group("request options")
    group.add_argument("--temperature", type=float, default=None, metavar="T",
                       help="sampling temperature sent with each request (default: none sent, the server's)")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="send ignore_eos so every request generates exactly its output length (default: on)")
    group.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="send one short untimed request first, which also checks the setup (default: on)")
    group = parser.add_argument_group("report options")
    group.add_argument("--metric-percentiles", type=percentile_list, default=DEFAULT_PERCENTILES, metavar="P,...",
                       help="percentiles reported besides mean and median (default: 90,99)")
    group.add_argument("--save-result", action="store_true",
                       help="save config, summary and per-request records as JSON (see --result-dir, "
                            "--result-filename)")
    group.add_argument("--result-dir", default=None, metavar="DIR",
                       help="folder of the --save-result file (default: the current one)")
    group.add_argument("--result-filename", default=None, metavar="FILE",
                       help="name of the --save-result file (default: vlite-serve-<rate>qps[-concurrency<N>]-"
                            "<model>-<date-time>.json)")
    group.add_argument("--output-json", default=None, metavar="FILE",
                       help="save the results as JSON to FILE (as the other benchmarks; same content as "
                            "--save-result)")
    group.add_argument("--plot", default=None, metavar="FILE.png",
                       help="draw TTFT and ITL percentiles over time and output tokens/s in 1-s bins (needs "
                            "matplotlib)")
    group.add_argument("--progress", action="store_true", help="show a progress bar of finished requests")


# --------------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------------

def arrival_times(num_requests: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times (seconds from the start) of `num_requests` requests arriving at `rate` per second.

    The first request goes at 0; the gaps are independent gamma(shape=burstiness, mean=1/rate) draws
    (exponential, i.e. a Poisson process, at burstiness 1). `rate=inf`: all at 0. Seeded.
    """
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be positive, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, theta)
        times.append(t)
    return times


# --------------------------------------------------------------------------------------------------
# Server-sent events
# --------------------------------------------------------------------------------------------------

class SSEParser:
    """Incremental server-sent events parser: feed text as it arrives, get the `data` of complete events.

    Follows the SSE rules a streaming OpenAI API needs: events end at a blank line, `data:` lines
    (one optional space after the colon) of one event are joined with newlines, lines starting with
    `:` are comments, other fields (`event:`, `id:`, `retry:`) are ignored; CRLF, CR and LF all end lines.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        events: list[str] = []
        while True:
            match = re.search(r"\r\n|\r|\n", self._buffer)
            if match is None:
                break
            if match.group() == "\r" and match.end() == len(self._buffer):
                break  # maybe the first half of a CRLF split across two reads
            line, self._buffer = self._buffer[:match.start()], self._buffer[match.end():]
            self._line(line, events)
        return events

    def flush(self) -> list[str]:
        """The last event when the stream ended without its blank line."""
        events: list[str] = []
        if self._buffer:
            self._line(self._buffer.rstrip("\r"), events)
            self._buffer = ""
        self._line("", events)
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


@dataclass
class StreamEvent:
    """What one decoded chunk of a streamed completion says."""

    content: bool = False  # it carries generated output (text, or the finish of a choice)
    text: str = ""
    usage: Optional[dict[str, Any]] = None
    error: Optional[str] = None


def parse_chunk(chunk: Any, chat: bool = False) -> StreamEvent:
    """One JSON chunk of a /v1/completions (or chat) stream."""
    if not isinstance(chunk, dict):
        return StreamEvent(error=f"unexpected chunk {str(chunk)[:200]}")
    if chunk.get("error"):
        err = chunk["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        return StreamEvent(error=str(message or err))
    event = StreamEvent(usage=chunk.get("usage") or None)
    for choice in chunk.get("choices") or []:
        text = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
        event.text += text
        if text or choice.get("finish_reason"):
            event.content = True
    return event


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """One request's measurements; times in seconds (`*_at` from the benchmark start, the rest durations)."""

    index: int
    prompt_len: int
    output_len: int  # the max_tokens asked for
    scheduled_at: float = 0.0  # when the arrival schedule released it
    sent_at: float = 0.0  # when it was sent (later than scheduled_at when --max-concurrency held it back)
    success: bool = False
    status: Optional[int] = None
    error: str = ""
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    chunk_at: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    prompt_tokens: Optional[int] = None  # usage.prompt_tokens (chat: with the template)
    output_chars: int = 0

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def build_payload(model: str, request: BenchRequest, chat: bool, prompt_text: Optional[str] = None,
                  ignore_eos: bool = True, temperature: Optional[float] = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        if prompt_text is None:
            raise ValueError("chat requests need the prompt as text")
        payload["messages"] = [{"role": "user", "content": prompt_text}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = list(request.prompt_token_ids)
        payload["max_tokens"] = request.output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    if temperature is not None:
        payload["temperature"] = temperature
    return payload


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return str(data["error"].get("message") or data["error"])
        if isinstance(data, dict) and "detail" in data:
            return str(data["detail"])
    except ValueError:
        pass
    return body.strip()[:300]


async def stream_request(client: Any, url: str, headers: dict[str, str], payload: dict[str, Any],
                         record: RequestRecord, t0: float, chat: bool = False) -> RequestRecord:
    """Send one streaming request and fill `record` with its timings (never raises for a failed request)."""
    import httpx

    parser = SSEParser()
    start = time.perf_counter()
    record.sent_at = start - t0
    last: Optional[float] = None
    done = False
    chunks = 0

    def handle(data: str, now: float) -> bool:
        """False to stop reading."""
        nonlocal last, done, chunks
        if data.strip() == "[DONE]":
            done = True
            return False
        try:
            event = parse_chunk(json.loads(data), chat)
        except ValueError:
            record.error = f"invalid JSON in the stream: {data[:200]!r}"
            return False
        if event.error is not None:
            record.error = f"error event: {event.error}"
            return False
        if event.usage:
            if isinstance(event.usage.get("completion_tokens"), int):
                record.output_tokens = event.usage["completion_tokens"]
                record.output_tokens_from_usage = True
            if isinstance(event.usage.get("prompt_tokens"), int):
                record.prompt_tokens = event.usage["prompt_tokens"]
        if event.content:
            if record.ttft is None:
                record.ttft = now - start
            else:
                record.itl.append(now - last)  # type: ignore[operator]
            last = now
            chunks += 1
            record.chunk_at.append(now - t0)
            record.output_chars += len(event.text)
        return True

    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return record
            reading = True
            async for text in response.aiter_text():
                now = time.perf_counter()
                for data in parser.feed(text):
                    if reading:
                        reading = handle(data, now)
                if not reading:
                    break
            if reading:
                for data in parser.flush():
                    if reading:
                        reading = handle(data, time.perf_counter())
        record.e2e = time.perf_counter() - start
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return record
    if not record.output_tokens_from_usage:
        record.output_tokens = chunks
    if not record.error and not done:
        record.error = "the stream ended before data: [DONE]"
    if not record.error and record.ttft is None:
        record.error = "no output in the stream"
    record.success = not record.error
    return record


async def run_requests(client: Any, url: str, headers: dict[str, str], payloads: Sequence[dict[str, Any]],
                       requests: Sequence[BenchRequest], times: Sequence[float], chat: bool = False,
                       max_concurrency: Optional[int] = None,
                       on_done: Optional[Callable[[RequestRecord], None]] = None
                       ) -> tuple[list[RequestRecord], float]:
    """Send `payloads[i]` at `times[i]` (seconds from the start, at most `max_concurrency` in flight).

    Returns the records (in request order) and the duration: start to the last request's end.
    """
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(i, r.prompt_len, r.output_len, scheduled_at=t)
               for i, (r, t) in enumerate(zip(requests, times))]

    async def one(record: RequestRecord, payload: dict[str, Any]) -> None:
        if semaphore is None:
            await stream_request(client, url, headers, payload, record, t0, chat)
        else:
            async with semaphore:
                await stream_request(client, url, headers, payload, record, t0, chat)
        if on_done is not None:
            on_done(record)

    tasks = []
    t0 = time.perf_counter()
    for record, payload in zip(records, payloads):
        delay = t0 + record.scheduled_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(record, payload)))
    await asyncio.gather(*tasks)
    return records, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------

def _stats(values_s: Sequence[float], percentiles: Sequence[float], name: str) -> dict[str, float]:
    ms = [1e3 * v for v in values_s]
    mean = sum(ms) / len(ms) if ms else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if ms else math.nan
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": percentile(ms, 50), f"std_{name}_ms": std}
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out


def output_token_times(records: Sequence[RequestRecord]) -> list[tuple[float, float]]:
    """(time, tokens) of every content chunk of the successful requests: each request's output tokens
    spread evenly over its chunks (one token per chunk when the server sends one per chunk)."""
    out = []
    for r in records:
        if r.success and r.chunk_at:
            share = r.output_tokens / len(r.chunk_at)
            out.extend((t, share) for t in r.chunk_at)
    return out


def tokens_per_bin(records: Sequence[RequestRecord], duration: float, bin_s: float = 1.0) -> list[float]:
    """Output tokens/s in consecutive `bin_s` bins from the start: the tokens that arrived in each bin
    divided by `bin_s` (the last bin may be partial and is still divided by the whole `bin_s`)."""
    n = max(1, math.ceil(duration / bin_s - 1e-9))
    counts = [0.0] * n
    for t, tokens in output_token_times(records):
        counts[min(n - 1, max(0, int(t / bin_s)))] += tokens
    return [c / bin_s for c in counts]


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight (sent, not yet ended) at once."""
    edges = []
    for r in records:
        if r.e2e is not None:
            edges.append((r.sent_at, 1))
            edges.append((r.sent_at + r.e2e, -1))
    peak = current = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a start at the same time
        current += step
        peak = max(peak, current)
    return peak


def summarize_records(records: Sequence[RequestRecord], duration: float,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The benchmark's summary (vllm bench serve's keys): counts, throughputs, latency statistics in ms."""
    ok = [r for r in records if r.success]
    duration = max(duration, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    bins = tokens_per_bin(records, duration) if ok else []
    summary: dict[str, Any] = {
        "duration": duration,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_output_tokens_per_s": max(bins) if bins else 0.0,
        "max_concurrent_requests": peak_concurrency(ok),
    }
    summary.update(_stats([r.ttft for r in ok if r.ttft is not None], percentiles, "ttft"))
    summary.update(_stats([t for t in (r.tpot for r in ok) if t is not None], percentiles, "tpot"))
    summary.update(_stats([g for r in ok for g in r.itl], percentiles, "itl"))
    summary.update(_stats([r.e2e for r in ok if r.e2e is not None], percentiles, "e2el"))
    return summary


def format_report(summary: dict[str, Any], request_rate: float, max_concurrency: Optional[int],
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> str:
    """The report, laid out as `vllm bench serve` prints it."""
    width = 50
    lines = [f"{' Serving Benchmark Result ':=^{width}}"]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Request rate configured (RPS):", "inf" if math.isinf(request_rate) else float(request_rate))
    row("Maximum request concurrency:", max_concurrency if max_concurrency else "none")
    row("Benchmark duration (s):", float(summary["duration"]))
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", float(summary["request_throughput"]))
    row("Output token throughput (tok/s):", float(summary["output_throughput"]))
    row("Peak output token throughput (tok/s):", float(summary["max_output_tokens_per_s"]))
    row("Peak concurrent requests:", summary["max_concurrent_requests"])
    row("Total token throughput (tok/s):", float(summary["total_token_throughput"]))
    for key, title, short in METRICS:
        lines.append(f"{title:-^{width}}")
        row(f"Mean {short} (ms):", float(summary[f"mean_{key}_ms"]))
        row(f"Median {short} (ms):", float(summary[f"median_{key}_ms"]))
        for q in percentiles:
            row(f"P{q:g} {short} (ms):", float(summary[f"p{q:g}_{key}_ms"]))
    spec = summary.get("spec_decoding")
    if spec:
        lines.append(f"{' Speculative Decoding ':-^{width}}")
        row("Acceptance rate (%):", 100.0 * spec["acceptance_rate"])
        row("Acceptance length:", float(spec["mean_acceptance_length"]))
        row("Drafts:", int(spec["num_drafts"]))
        row("Draft tokens:", int(spec["num_draft_tokens"]))
        row("Accepted tokens:", int(spec["num_accepted_tokens"]))
    lines.append("=" * width)
    return "\n".join(lines)


_SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens": "accepted"}


async def scrape_spec_counters(client: Any, base_url: str) -> Optional[dict[str, float]]:
    """The server's speculative-decoding counters from /metrics (vLLM's names), or None when it has none."""
    try:
        r = await client.get(base_url + "/metrics")
    except Exception:  # no /metrics (another server): the report just leaves the section out
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in _SPEC_COUNTERS:
            out[_SPEC_COUNTERS[name]] = out.get(_SPEC_COUNTERS[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return out if len(out) == len(_SPEC_COUNTERS) else None


def spec_decoding_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Acceptance over the run from the server's counters (/metrics): rate (accepted / draft tokens) and
    length (1 + accepted / drafts, vLLM's)."""
    from vlite.core.sched.scheduler import SpecDecodingStats

    def stats(c: dict[str, float]) -> SpecDecodingStats:
        return SpecDecodingStats(c["drafts"], c["draft_tokens"], c["accepted"])

    report = spec_decoding_report(stats(before), stats(after))
    assert report is not None
    return report


# --------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------

def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None


def plot_results(records: Sequence[RequestRecord], duration: float, path: str,
                 percentiles: Sequence[float] = (50.0, 90.0, 99.0), title: str = "") -> None:
    """Three panels over the benchmark's time, in 1-s bins: TTFT percentiles (requests by send time, each
    request a dot), ITL percentiles (gaps by arrival time), output tokens/s with the requests in flight."""
    require_matplotlib()
    from matplotlib.figure import Figure

    ok = [r for r in records if r.success]
    n = max(1, math.ceil(duration - 1e-9))
    centers = [i + 0.5 for i in range(n)]

    def binned(points: list[tuple[float, float]]) -> list[list[float]]:
        bins: list[list[float]] = [[] for _ in range(n)]
        for t, v in points:
            bins[min(n - 1, max(0, int(t)))].append(v)
        return bins

    fig = Figure(figsize=(10, 10), layout="constrained")
    ax_ttft, ax_itl, ax_tok = fig.subplots(3, 1, sharex=True)
    ttft_points = [(r.sent_at, 1e3 * r.ttft) for r in ok if r.ttft is not None]
    itl_points = [(t, 1e3 * g) for r in ok for t, g in zip(r.chunk_at[1:], r.itl)]
    for ax, points, name in ((ax_ttft, ttft_points, "TTFT"), (ax_itl, itl_points, "ITL")):
        if name == "TTFT" and points:
            ax.scatter([p[0] for p in points], [p[1] for p in points], s=6, alpha=0.3, color="gray",
                       label="each request")
        bins = binned(points)
        for q in percentiles:
            ys = [percentile(b, q) if b else math.nan for b in bins]
            ax.plot(centers, ys, marker="o", markersize=3, label=f"p{q:g}")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} percentiles per 1-s bin" + (" (by send time)" if name == "TTFT" else
                                                           " (by token arrival)"))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    rates = tokens_per_bin(records, duration)
    ax_tok.bar(centers[:len(rates)], rates, width=0.9, color="tab:blue", alpha=0.7, label="output tok/s")
    ax_tok.set_ylabel("output tokens/s")
    ax_tok.set_xlabel("time since the benchmark start (s)")
    ax_tok.set_title("output token throughput per 1-s bin, and requests in flight")
    ax_tok.grid(alpha=0.3)
    steps = sorted([(r.sent_at, 1) for r in ok if r.e2e is not None] +
                   [(r.sent_at + r.e2e, -1) for r in ok if r.e2e is not None], key=lambda e: (e[0], e[1]))
    if steps:
        xs, ys, current = [0.0], [0], 0
        for t, step in steps:
            current += step
            xs.append(t)
            ys.append(current)
        ax_conc = ax_tok.twinx()
        ax_conc.step(xs, ys, where="post", color="tab:red", label="requests in flight")
        ax_conc.set_ylabel("requests in flight")
        ax_conc.legend(loc="upper right", fontsize="small")
    ax_tok.legend(loc="upper left", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    print(f"plot saved to {path}", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# Setup: server, model, vocabulary
# --------------------------------------------------------------------------------------------------

def api_key_from(ns_key: Optional[str]) -> Optional[str]:
    return ns_key or os.environ.get("VLITE_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


def headers_for(api_key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_models(client: Any, base_url: str, headers: dict[str, str], ready_timeout: float = 0.0
                       ) -> list[dict[str, Any]]:
    """The server's /v1/models entries; waits up to `ready_timeout` s for it to answer 200."""
    import httpx

    deadline = time.monotonic() + ready_timeout
    said = False
    while True:
        try:
            response = await client.get(f"{base_url}/v1/models", headers=headers)
            if response.status_code == 200:
                data = response.json().get("data") or []
                if not data:
                    raise ValueError(f"{base_url}/v1/models lists no model")
                return data
            problem = f"{base_url}/v1/models answered {response.status_code}: {_error_message(response.text)}"
            if response.status_code == 401:
                raise ValueError(problem + " (give the key with --api-key or VLITE_API_KEY)")
        except httpx.HTTPError as e:
            problem = (f"cannot reach the server at {base_url} ({type(e).__name__}: {e}); start one with "
                       "`vlite serve` or give --base-url")
        if time.monotonic() >= deadline:
            raise ValueError(problem)
        if not said:
            print(f"waiting for the server at {base_url}...", file=sys.stderr, flush=True)
            said = True
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def tokenizer_model_for(model_id: str, root: Optional[str], tokenizer_arg: Optional[str]
                        ) -> tuple[bool, Optional[str]]:
    """Which model's tokenizer gives the random prompts' vocabulary: (found, `resolve_model` argument).

    `--tokenizer` wins; else the served model when its id or root names the bundled default model,
    or when its id is a local path. (False, None) means: no tokenizer, use FALLBACK_TOKEN_IDS.
    """
    if tokenizer_arg:
        return True, tokenizer_arg
    from vlite.model_loader.resolve import DEFAULT_GGUF_NAME

    default_names = {DEFAULT_GGUF_NAME, Path(DEFAULT_GGUF_NAME).stem}
    if model_id in default_names or root in default_names:
        return True, None
    for candidate in (model_id, root):
        if candidate and Path(candidate).expanduser().exists():
            return True, candidate
    return False, None


def load_vocabulary(model_id: str, root: Optional[str], tokenizer_arg: Optional[str]
                    ) -> tuple[Optional[Any], Sequence[int], str]:
    """(tokenizer or None, the token ids random prompts draw from, a description of where they came from)."""
    found, name = tokenizer_model_for(model_id, root, tokenizer_arg)
    if found:
        from vlite.benchmarks.datasets import allowed_token_ids
        from vlite.model_loader import load_tokenizer, resolve_model

        resolved = resolve_model(name)
        tokenizer = load_tokenizer(resolved)
        pool = allowed_token_ids(len(tokenizer), tokenizer_special_ids(tokenizer))
        return tokenizer, pool, f"the tokenizer of {resolved.name} ({len(tokenizer)} tokens)"
    return None, FALLBACK_TOKEN_IDS, (f"token ids {FALLBACK_TOKEN_IDS.start}..{FALLBACK_TOKEN_IDS.stop - 1} (the "
                                      "served model's tokenizer is unknown; --tokenizer sets it)")


async def prompt_texts(client: Any, base_url: str, headers: dict[str, str], model: str,
                       requests: Sequence[BenchRequest], tokenizer: Any) -> list[str]:
    """The prompts as text (for chat): decoded by the tokenizer, else by the server's /detokenize."""
    if tokenizer is not None:
        return [tokenizer.decode(r.prompt_token_ids) for r in requests]
    texts = []
    for r in requests:
        response = await client.post(f"{base_url}/detokenize", headers=headers,
                                     json={"model": model, "tokens": r.prompt_token_ids})
        if response.status_code != 200:
            raise ValueError(f"{base_url}/detokenize answered {response.status_code}: "
                             f"{_error_message(response.text)}; give --tokenizer to decode the prompts here")
        texts.append(response.json()["prompt"])
    return texts


def result_path(ns: argparse.Namespace, model: str) -> Optional[str]:
    """Where the JSON goes: --output-json, else with --save-result --result-dir/--result-filename."""
    if ns.output_json:
        return ns.output_json
    if not ns.save_result:
        return None
    name = ns.result_filename
    if not name:
        rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
        concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
        safe_model = re.sub(r"[^A-Za-z0-9._-]+", "_", model.split("/")[-1]) or "model"
        name = f"vlite-serve-{rate}qps{concurrency}-{safe_model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if ns.result_dir:
        os.makedirs(ns.result_dir, exist_ok=True)
        return os.path.join(ns.result_dir, name)
    return name


# --------------------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------------------

async def _run(ns: argparse.Namespace) -> tuple[dict[str, Any], list[RequestRecord]]:
    import httpx

    base_url = ns.base_url.rstrip("/")
    chat = ns.endpoint.endswith("/chat/completions")
    headers = headers_for(api_key_from(ns.api_key))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: no proxy from the environment between the benchmark and the server.
    async with httpx.AsyncClient(timeout=httpx.Timeout(ns.request_timeout), limits=limits,
                                 trust_env=False) as client:
        models = await fetch_models(client, base_url, headers, ns.ready_timeout)
        served = models[0]
        model = ns.model or str(served["id"])
        root = next((m.get("root") for m in models if m.get("id") == model), None)

        tokenizer, vocab_source = None, "--dataset-path"
        if ns.dataset_path:
            requests = load_json_dataset(ns.dataset_path, ns.num_prompts)
            if chat and tokenizer_model_for(model, root, ns.tokenizer)[0]:
                tokenizer, _, _ = load_vocabulary(model, root, ns.tokenizer)
        else:
            tokenizer, pool, vocab_source = load_vocabulary(model, root, ns.tokenizer)
            requests = random_requests(ns.num_prompts or DEFAULT_NUM_PROMPTS, ns.input_len, ns.output_len,
                                       ns.range_ratio, ns.seed, token_ids=pool)
        texts: list[Optional[str]] = [None] * len(requests)
        if chat:
            texts = list(await prompt_texts(client, base_url, headers, model, requests, tokenizer))
        payloads = [build_payload(model, r, chat, text, ns.ignore_eos, ns.temperature)
                    for r, text in zip(requests, texts)]
        url = base_url + ns.endpoint
        counts = summarize(requests)
        print(f"vlite bench serve: {url}, model {model}, {counts['num_requests']} requests "
              f"({counts['input_tokens']} input, {counts['output_tokens']} output tokens); prompts from "
              f"{vocab_source}", file=sys.stderr)
        rate_text = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g} requests/s"
        print(f"request rate: {rate_text}" + (f", burstiness {ns.burstiness:g}" if ns.burstiness != 1 else "") +
              f"; max concurrency: {ns.max_concurrency or 'none'}", file=sys.stderr)

        if ns.warmup:
            first = requests[0]
            warm = BenchRequest(list(reversed(first.prompt_token_ids)), min(first.output_len, 4))
            warm_text = texts[0][::-1] if chat and texts[0] is not None else None
            record = await stream_request(client, url, headers,
                                          build_payload(model, warm, chat, warm_text, ns.ignore_eos, ns.temperature),
                                          RequestRecord(-1, warm.prompt_len, warm.output_len), time.perf_counter(),
                                          chat)
            if not record.success:
                raise ValueError(f"the warmup request failed: {record.error}")

        bar = None
        if ns.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), unit="req", file=sys.stderr)
        times = arrival_times(len(requests), ns.request_rate, ns.seed, ns.burstiness)
        spec_before = await scrape_spec_counters(client, base_url)
        try:
            records, duration = await run_requests(client, url, headers, payloads, requests, times, chat,
                                                   ns.max_concurrency,
                                                   on_done=(lambda r: bar.update(1)) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        spec_after = await scrape_spec_counters(client, base_url)

    summary = summarize_records(records, duration, ns.metric_percentiles)
    if spec_before is not None and spec_after is not None and spec_after["drafts"] > spec_before["drafts"]:
        summary["spec_decoding"] = spec_decoding_summary(spec_before, spec_after)
    print(format_report(summary, ns.request_rate, ns.max_concurrency, ns.metric_percentiles), flush=True)
    errors = [r for r in records if not r.success]
    for r in errors[:5]:
        print(f"request {r.index} failed: {r.error}", file=sys.stderr)
    if len(errors) > 5:
        print(f"... and {len(errors) - 5} more failed requests", file=sys.stderr)
    results = {
        "benchmark": "serve",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {"base_url": base_url, "endpoint": ns.endpoint, "model": model, "model_root": root,
                   "prompts_from": vocab_source, "request_rate": "inf" if math.isinf(ns.request_rate)
                   else ns.request_rate, "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency,
                   "args": {k: v for k, v in jsonable_args(ns).items() if k != "api_key"}},
        "summary": summary,
        "requests": [r.to_dict() for r in records],
    }
    return results, records


def run_serve_bench(ns: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark from parsed flags; returns the results (also printed, and saved if asked)."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ValueError("vlite bench serve needs httpx: pip install httpx") from None
    if ns.plot:
        require_matplotlib()  # before the run, not after it
    if ns.dataset_path:
        load_json_dataset(ns.dataset_path, ns.num_prompts)  # a bad file fails before anything is sent
    results, records = asyncio.run(_run(ns))
    if ns.plot:
        plot_results(records, results["summary"]["duration"], ns.plot,
                     title=f"vlite bench serve: {results['config']['model']}, rate "
                           f"{results['config']['request_rate']}, concurrency {ns.max_concurrency or 'none'}")
    write_json(result_path(ns, results["config"]["model"]), results)
    return results


def main(ns: argparse.Namespace) -> int:
    results = run_serve_bench(ns)
    return 0 if results["summary"]["completed"] else 1

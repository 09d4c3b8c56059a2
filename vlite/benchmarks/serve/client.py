"""The client side of `vlite bench serve`: one streamed request timed chunk by chunk, many sent on a schedule.

`stream_request` reads a server-sent-events stream (`SSEParser`, `parse_chunk`) into a `RequestRecord`
and never raises for a failed request; `run_requests` sends each payload at its arrival time, at most
`max_concurrency` at once. `fetch_models` is the first contact with the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from vlite.benchmarks.datasets import BenchRequest

# --------------------------------------------------------------------------------------------------
# Server
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
            problem = f"{base_url}/v1/models answered {response.status_code}: {error_message(response.text)}"
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


def error_message(body: str) -> str:
    """The error in a server's answer: OpenAI's `error.message`, FastAPI's `detail`, else the body (cut)."""
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
                record.error = f"HTTP {response.status_code}: {error_message(body)}"
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

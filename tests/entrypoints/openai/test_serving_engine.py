"""The pieces the completions and chat handlers share (serving_engine.py), without a server."""

from __future__ import annotations

import asyncio
import json
from typing import Optional

from vlite.entrypoints.openai.protocol import StreamOptions
from vlite.entrypoints.openai.serving_engine import ChoiceState, OpenAIError, OpenAIServing, Usage, sse


def test_sse_event_survives_unicode_line_splitting():
    """U+2028/U+2029/U+0085 in generated text must not end the event's line for clients that split
    with str.splitlines (httpx's aiter_lines): they are escaped, and the JSON decodes to the same text."""
    data = {"choices": [{"delta": {"content": "a\u2028b\u2029c\x85d\ne é"}}]}
    event = sse(data)
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == data


def _events(choices, usage: Usage, opts: Optional[StreamOptions]) -> list[str]:
    async def collect() -> list[str]:
        return [e async for e in OpenAIServing._stream(choices, "id-1", "text_completion", "m", usage, opts)]

    return asyncio.run(collect())


async def _two_chunks(usage: Usage, fail: Optional[Exception] = None):
    for i in range(2):
        usage.choices.setdefault(0, ChoiceState()).completion_tokens += 1
        yield [{"index": 0, "text": str(i)}]
    if fail is not None:
        raise fail


def test_stream_chunks_usage_and_done():
    usage = Usage(prompt_tokens=3)
    events = _events(_two_chunks(usage), usage, StreamOptions(include_usage=True, continuous_usage_stats=True))
    assert events[-1] == "data: [DONE]\n\n"
    bodies = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [b["choices"] for b in bodies] == [[{"index": 0, "text": "0"}], [{"index": 0, "text": "1"}], []]
    # Continuous usage: each chunk carries the counts as of that chunk; the last chunk has the totals.
    assert [b["usage"]["completion_tokens"] for b in bodies] == [1, 2, 2]
    assert bodies[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert all(b["id"] == "id-1" and b["object"] == "text_completion" and b["model"] == "m" for b in bodies)

    usage = Usage(prompt_tokens=3)
    bodies = [json.loads(e[len("data: "):]) for e in _events(_two_chunks(usage), usage, StreamOptions(
        include_usage=True))[:-1]]
    assert [b["usage"] for b in bodies[:-1]] == [None, None] and bodies[-1]["usage"]["total_tokens"] == 5

    usage = Usage()
    bodies = [json.loads(e[len("data: "):]) for e in _events(_two_chunks(usage), usage, None)[:-1]]
    assert len(bodies) == 2 and all("usage" not in b for b in bodies)


def test_stream_error_is_an_event_then_done():
    usage = Usage()
    events = _events(_two_chunks(usage, OpenAIError("bad field", 400, "field")), usage, None)
    assert events[-1] == "data: [DONE]\n\n"
    assert json.loads(events[-2][len("data: "):]) == {"error": {"message": "bad field", "type": "BadRequestError",
                                                                "param": "field", "code": 400}}
    events = _events(_two_chunks(usage, RuntimeError()), usage, None)
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == 500

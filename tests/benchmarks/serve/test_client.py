"""`vlite.benchmarks.serve.client`: server-sent events and the chunks of a streamed completion."""

from __future__ import annotations

from vlite.benchmarks.serve.client import SSEParser, parse_chunk


def test_sse_parser_split_reads():
    stream = 'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\n: keep-alive\n\nevent: x\ndata: [DONE]\n\n'
    for size in (1, 2, 3, 7, len(stream)):  # any split of the stream gives the same events
        parser = SSEParser()
        events = []
        for i in range(0, len(stream), size):
            events += parser.feed(stream[i:i + size])
        events += parser.flush()
        assert events == ['{"a": 1}', '{"b": 2}', "[DONE]"], size


def test_sse_parser_multiline_data_cr_and_flush():
    parser = SSEParser()
    assert parser.feed("data: line1\rdata:line2\r") == []
    assert parser.feed("\r") == []  # a CR at the end may be the first half of a CRLF: wait for the next read
    assert parser.feed("data: tail") == ["line1\nline2"]
    assert parser.flush() == ["tail"]
    assert parser.flush() == []


def test_parse_chunk():
    ev = parse_chunk({"choices": [{"index": 0, "text": "hi", "finish_reason": None}], "usage": None})
    assert ev.content and ev.text == "hi" and ev.usage is None and ev.error is None
    assert not parse_chunk({"choices": [{"text": "", "finish_reason": None}]}).content  # a held-back byte
    assert parse_chunk({"choices": [{"text": "", "finish_reason": "length"}]}).content  # the finish counts
    usage = parse_chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert not usage.content and usage.usage["completion_tokens"] == 4
    role = parse_chunk({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
                       chat=True)
    assert not role.content  # the chat role chunk is no output
    assert parse_chunk({"choices": [{"delta": {"content": "x"}}]}, chat=True).content
    assert parse_chunk({"error": {"message": "boom", "code": 500}}).error == "boom"
    assert parse_chunk([1]).error

"""`vlite bench serve`: arrival schedule, SSE parsing, summary math, and whole runs against a tiny in-process fake
OpenAI server (FastAPI + uvicorn in a thread, streaming fake chunks with small sleeps; no model). One slow smoke
test runs it against a real `vlite serve`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import sys
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from vlite.benchmarks import serve
from vlite.benchmarks.serve import (FALLBACK_TOKEN_IDS, RequestRecord, SSEParser, arrival_times, parse_chunk,
                                    peak_concurrency, summarize_records, tokens_per_bin)
from vlite.entrypoints import cli


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", "serve", *argv])


# --------------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------------

def test_serve_defaults():
    ns = parse()
    assert ns.base_url == "http://127.0.0.1:8000" and ns.endpoint == "/v1/completions" and ns.model is None
    assert math.isinf(ns.request_rate) and ns.max_concurrency is None and ns.burstiness == 1.0
    assert ns.ignore_eos and ns.warmup and ns.temperature is None and ns.num_prompts is None
    assert ns.metric_percentiles == (90.0, 99.0) and not ns.save_result and ns.plot is None
    assert not hasattr(ns, "dtype")  # no engine flags: nothing is loaded


def test_serve_flags():
    ns = parse("--base-url", "http://h:1", "--api-key", "k", "--model", "m", "--endpoint", "/v1/chat/completions",
               "--num-prompts", "7", "--input-len", "16", "--output-len", "4", "--range-ratio", "0.5", "--seed", "3",
               "--request-rate", "2.5", "--burstiness", "0.5", "--max-concurrency", "2", "--temperature", "0",
               "--no-ignore-eos", "--no-warmup", "--metric-percentiles", "50,95", "--save-result",
               "--result-dir", "d", "--result-filename", "f.json", "--plot", "p.png", "--progress")
    assert (ns.base_url, ns.api_key, ns.model, ns.endpoint) == ("http://h:1", "k", "m", "/v1/chat/completions")
    assert (ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, ns.seed) == (7, 16, 4, 0.5, 3)
    assert (ns.request_rate, ns.burstiness, ns.max_concurrency, ns.temperature) == (2.5, 0.5, 2, 0.0)
    assert not ns.ignore_eos and not ns.warmup and ns.metric_percentiles == (50.0, 95.0)
    assert ns.save_result and ns.result_dir == "d" and ns.result_filename == "f.json" and ns.plot == "p.png"
    assert math.isinf(parse("--request-rate", "inf").request_rate)


@pytest.mark.parametrize("argv", [
    ["--request-rate", "0"], ["--request-rate", "-1"], ["--request-rate", "nan"], ["--request-rate", "x"],
    ["--max-concurrency", "0"], ["--burstiness", "0"], ["--endpoint", "/v1/embeddings"],
    ["--metric-percentiles", "100"], ["--metric-percentiles", "a"], ["--range-ratio", "1"],
])
def test_serve_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)


# --------------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------------

def test_arrival_times_inf_all_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_arrival_times_poisson_seeded_mean_rate():
    times = arrival_times(20001, rate=5.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)  # mean gap 1/rate
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert len(gaps) / times[-1] == pytest.approx(5.0, rel=0.03)
    assert arrival_times(50, 5.0, seed=1) == times[:50]  # seeded: the same prefix
    assert arrival_times(50, 5.0, seed=2) != times[:50]


def test_arrival_times_burstiness_keeps_the_mean():
    times = arrival_times(20001, rate=10.0, seed=0, burstiness=4.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)  # gamma: 1/sqrt(k)


def test_arrival_times_rejects():
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0.0)


# --------------------------------------------------------------------------------------------------
# SSE
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# Summary math
# --------------------------------------------------------------------------------------------------

def _record(i, ttft, gaps, tokens, sent_at=0.0, prompt_len=10, success=True):
    chunk_at = [sent_at + ttft]
    for g in gaps:
        chunk_at.append(chunk_at[-1] + g)
    e2e = chunk_at[-1] - sent_at
    return RequestRecord(i, prompt_len, tokens, sent_at=sent_at, success=success, ttft=ttft, e2e=e2e,
                         itl=list(gaps), chunk_at=chunk_at, output_tokens=tokens, output_tokens_from_usage=True)


def test_summarize_records_math():
    records = [
        _record(0, 0.1, [0.02, 0.02, 0.02], 4, sent_at=0.0),  # e2e 0.16, tpot 0.02
        _record(1, 0.3, [0.05], 2, sent_at=0.5),  # e2e 0.35, tpot 0.05
        _record(2, 0.2, [], 1, sent_at=1.0),  # one token: no TPOT, no ITL
        RequestRecord(3, 99, 5, sent_at=0.2, error="HTTP 500: x"),  # failed: counted nowhere else
    ]
    s = summarize_records(records, duration=2.0, percentiles=(90, 99))
    assert (s["num_prompts"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5) and s["total_token_throughput"] == pytest.approx(18.5)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0) and s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(2 / 3) * 100)
    assert s["mean_tpot_ms"] == pytest.approx(35.0) and s["median_tpot_ms"] == pytest.approx(35.0)
    assert s["mean_itl_ms"] == pytest.approx(27.5) and s["median_itl_ms"] == pytest.approx(20.0)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 350 + 200) / 3)
    assert s["max_concurrent_requests"] == 1  # 0..0.16, 0.5..0.85, 1.0..1.2: never two at once
    assert s["max_output_tokens_per_s"] == pytest.approx(6.0)  # 4 tokens at 0.1..0.16 and 2 at 0.8, 0.85: bin 0


def test_tokens_per_bin_and_peak_concurrency():
    a = _record(0, 0.1, [0.5, 0.5], 3, sent_at=0.0)  # chunks at 0.1, 0.6, 1.1
    b = _record(1, 0.2, [1.0], 4, sent_at=0.5)  # 2 chunks (2 tokens each) at 0.7, 1.7
    assert tokens_per_bin([a, b], duration=2.5) == [4.0, 3.0, 0.0]
    assert tokens_per_bin([a], duration=0.3) == [3.0]  # one bin at least, divided by 1 s
    assert peak_concurrency([a, b]) == 2
    c = _record(2, 0.1, [], 1, sent_at=5.0)
    assert peak_concurrency([a, c]) == 1
    back_to_back = [_record(0, 1.0, [], 1, sent_at=0.0), _record(1, 1.0, [], 1, sent_at=1.0)]
    assert peak_concurrency(back_to_back) == 1  # an end and a start at the same instant


def test_summary_when_everything_failed():
    s = summarize_records([RequestRecord(0, 5, 5, error="x")], duration=1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["output_throughput"] == 0.0
    assert math.isnan(s["mean_ttft_ms"]) and math.isnan(s["p99_itl_ms"])
    assert "Failed requests:" in serve.format_report(s, math.inf, None)


def test_format_report_layout():
    records = [_record(0, 0.1, [0.02, 0.02], 3), _record(1, 0.2, [0.03], 2, sent_at=0.1)]
    s = summarize_records(records, 1.0, (90, 99))
    text = serve.format_report(s, 4.0, 8, (90, 99))
    lines = text.splitlines()
    assert lines[0].startswith("=") and "Serving Benchmark Result" in lines[0] and lines[-1] == "=" * 50
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Total token throughput (tok/s):", "Request rate configured (RPS):", "Maximum request concurrency:",
                  "Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                  "End-to-end Latency"):
        assert label in text, label
    for short in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "Median", "P90", "P99"):
            assert f"{stat} {short} (ms):" in text
    assert re.search(r"Mean TTFT \(ms\):\s+150\.00$", text, re.M)
    assert all(len(line) == 50 for line in lines)


def test_tokenizer_choice():
    assert serve.tokenizer_model_for("anything", None, "some/repo") == (True, "some/repo")
    assert serve.tokenizer_model_for("SmolLM2-135M-Instruct.Q4_1", None, None) == (True, None)  # vlite serve's id
    assert serve.tokenizer_model_for("alias", "SmolLM2-135M-Instruct.Q4_1.gguf", None) == (True, None)  # its root
    assert serve.tokenizer_model_for("org/not-local", "not-local", None) == (False, None)


def test_tokenizer_choice_local_path(tmp_path):
    assert serve.tokenizer_model_for(str(tmp_path), None, None) == (True, str(tmp_path))


# --------------------------------------------------------------------------------------------------
# A fake OpenAI server
# --------------------------------------------------------------------------------------------------

FAKE_KEY = "fake-key"
FIRST_DELAY = 0.05  # before the first token
TOKEN_DELAY = 0.01  # between tokens


def _fake_app(received: list) -> FastAPI:
    app = FastAPI()

    def unauthorized(request: Request):
        if request.headers.get("authorization") != f"Bearer {FAKE_KEY}":
            return JSONResponse({"error": {"message": "invalid API key", "code": 401}}, status_code=401)
        return None

    @app.get("/v1/models")
    async def models(request: Request):
        return unauthorized(request) or {"object": "list", "data": [{"id": "fake-model", "root": "fake-root"}]}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await request.json()
        return unauthorized(request) or {"prompt": " ".join(f"w{t}" for t in body["tokens"])}

    async def stream(body: dict, chat: bool):
        mode = body["model"]
        n = body.get("max_completion_tokens" if chat else "max_tokens") or 1
        usage = (body.get("stream_options") or {}).get("include_usage") and mode != "no-usage"
        if chat:
            yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
        await asyncio.sleep(FIRST_DELAY)
        for i in range(n):
            if i:
                await asyncio.sleep(TOKEN_DELAY)
            if mode == "fail-stream" and i == 1:
                yield 'data: {"error": {"message": "engine exploded", "code": 500}}\n\n'
                yield "data: [DONE]\n\n"
                return
            finish = "length" if i == n - 1 else None
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
            choice["finish_reason"] = finish
            yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
        if usage:
            prompt_tokens = len(body["prompt"]) if not chat else 99
            yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': prompt_tokens, 'completion_tokens': n}})}\n\n"  # noqa: E501
        if mode != "no-done":
            yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        denied = unauthorized(request)
        if denied:
            return denied
        body = await request.json()
        received.append(body)
        if body["model"] == "fail-http":
            return JSONResponse({"error": {"message": "bad request here", "code": 400}}, status_code=400)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    from tests.entrypoints.openai.conftest import free_port

    received: list = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_fake_app(received), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", received
    server.should_exit = True
    thread.join(10)


def run_bench(url: str, tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "serve.json"
    rc = cli.main(["bench", "serve", "--base-url", url, "--api-key", FAKE_KEY, "--output-json", str(out), *argv])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def test_fake_server_run(fake_server, tmp_path, capsys):
    url, received = fake_server
    received.clear()
    rc, saved = run_bench(url, tmp_path, "--num-prompts", "6", "--input-len", "8", "--output-len", "5")
    assert rc == 0
    out = capsys.readouterr()
    assert "Serving Benchmark Result" in out.out and "token ids 1000..29999" in out.err
    s = saved["summary"]
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (6, 0, 48, 30)
    assert saved["config"]["model"] == "fake-model" and saved["config"]["model_root"] == "fake-root"
    assert "api_key" not in saved["config"]["args"]  # the key is not written to disk
    # One warmup (4 tokens, reversed prompt) and then the 6 requests, as the server received them.
    assert len(received) == 7 and received[0]["max_tokens"] == 4
    # (the 6 are sent concurrently, so they may arrive in any order)
    assert list(reversed(received[0]["prompt"])) in [body["prompt"] for body in received[1:]]
    for body in received[1:]:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 5 and "temperature" not in body
        assert len(body["prompt"]) == 8 and all(t in FALLBACK_TOKEN_IDS for t in body["prompt"])
    for r in saved["requests"]:
        assert r["success"] and r["output_tokens"] == 5 and r["output_tokens_from_usage"]
        assert r["ttft"] >= 0.9 * FIRST_DELAY and len(r["itl"]) == 4 and len(r["chunk_at"]) == 5
        assert all(g >= 0.5 * TOKEN_DELAY for g in r["itl"])
        assert r["e2e"] >= r["ttft"] + sum(r["itl"]) - 1e-6
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / 4)
        assert r["prompt_tokens"] == 8 and r["output_chars"] == len("t0 t1 t2 t3 t4 ")
    assert s["mean_ttft_ms"] >= 0.9 * 1e3 * FIRST_DELAY and s["mean_tpot_ms"] >= 0.5 * 1e3 * TOKEN_DELAY
    assert s["request_throughput"] == pytest.approx(6 / s["duration"])
    assert s["max_concurrent_requests"] >= 1


def test_fake_server_max_concurrency_one(fake_server, tmp_path, capsys):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--num-prompts", "3", "--input-len", "4", "--output-len", "2",
                          "--max-concurrency", "1", "--no-warmup")
    assert rc == 0 and saved["summary"]["max_concurrent_requests"] == 1
    reqs = saved["requests"]
    for a, b in zip(reqs, reqs[1:]):  # strictly one after the other
        assert b["sent_at"] >= a["sent_at"] + a["e2e"] - 1e-6
    assert saved["summary"]["duration"] >= 3 * FIRST_DELAY


def test_fake_server_request_rate_schedule(fake_server, tmp_path, capsys):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--num-prompts", "4", "--input-len", "4", "--output-len", "2",
                          "--request-rate", "20", "--seed", "5", "--no-warmup")
    assert rc == 0
    expected = arrival_times(4, 20.0, seed=5)
    reqs = saved["requests"]
    assert [r["scheduled_at"] for r in reqs] == pytest.approx(expected)
    assert all(r["sent_at"] >= r["scheduled_at"] - 1e-6 for r in reqs)
    assert saved["summary"]["duration"] >= expected[-1]
    assert saved["config"]["request_rate"] == 20.0
    assert "Request rate configured (RPS):" in capsys.readouterr().out


def test_fake_server_chat(fake_server, tmp_path, capsys):
    url, received = fake_server
    received.clear()
    rc, saved = run_bench(url, tmp_path, "--endpoint", "/v1/chat/completions", "--num-prompts", "2",
                          "--input-len", "3", "--output-len", "3", "--temperature", "0", "--no-warmup")
    assert rc == 0
    for body in received:
        assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"].startswith("w")
        assert body["max_completion_tokens"] == 3 and body["temperature"] == 0
    for r in saved["requests"]:  # the role chunk is not the first token
        assert r["success"] and r["ttft"] >= 0.9 * FIRST_DELAY and len(r["itl"]) == 2 and r["output_tokens"] == 3


def test_fake_server_without_usage_counts_chunks(fake_server, tmp_path, capsys):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--model", "no-usage", "--num-prompts", "2", "--input-len", "2",
                          "--output-len", "3", "--no-warmup")
    assert rc == 0
    assert all(r["output_tokens"] == 3 and not r["output_tokens_from_usage"] for r in saved["requests"])


@pytest.mark.parametrize("model, message", [
    ("fail-http", "HTTP 400: bad request here"), ("fail-stream", "error event: engine exploded"),
    ("no-done", "the stream ended before data: [DONE]"),
])
def test_fake_server_failures(fake_server, tmp_path, capsys, model, message):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--model", model, "--num-prompts", "2", "--input-len", "2",
                          "--output-len", "3", "--no-warmup")
    assert rc == 1  # nothing succeeded
    assert saved["summary"]["completed"] == 0 and saved["summary"]["failed"] == 2
    assert all(r["error"] == message for r in saved["requests"])
    err = capsys.readouterr().err
    assert f"request 0 failed: {message}" in err


def test_fake_server_failing_warmup_stops_the_run(fake_server, tmp_path, capsys):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--model", "fail-http", "--num-prompts", "2", "--input-len", "2")
    assert rc == 2 and saved == {}
    assert "the warmup request failed: HTTP 400: bad request here" in capsys.readouterr().err


def test_fake_server_api_key(fake_server, tmp_path, capsys, monkeypatch):
    url, _ = fake_server
    monkeypatch.delenv("VLITE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "answered 401: invalid API key" in err and "--api-key" in err
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)  # the key from the environment
    out = tmp_path / "env.json"
    assert cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "1", "--input-len", "2", "--output-len",
                     "2", "--no-warmup", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["completed"] == 1


def test_unreachable_server(capsys):
    from tests.entrypoints.openai.conftest import free_port

    rc = cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"])
    assert rc == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_fake_server_save_result_and_plot(fake_server, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    url, _ = fake_server
    png = tmp_path / "plot.png"
    rc = cli.main(["bench", "serve", "--base-url", url, "--api-key", FAKE_KEY, "--num-prompts", "4",
                   "--input-len", "4", "--output-len", "3", "--request-rate", "50", "--no-warmup", "--save-result",
                   "--result-dir", str(tmp_path / "results"), "--plot", str(png)])
    assert rc == 0
    files = list((tmp_path / "results").iterdir())
    assert len(files) == 1 and re.fullmatch(r"vlite-serve-50qps-fake-model-\d{8}-\d{6}\.json", files[0].name)
    saved = json.loads(files[0].read_text())
    assert len(saved["requests"]) == 4 and saved["summary"]["completed"] == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    assert "--plot needs matplotlib, which is not installed: pip install matplotlib" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# A real `vlite serve` (slow)
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    from tests.entrypoints.openai.conftest import start_server, stop_server

    srv = start_server(tmp_path_factory, "--kv-cache-memory", "64M")
    yield srv
    assert stop_server(srv) == 0, open(srv.log_path).read()[-3000:]


@pytest.mark.slow
def test_serve_bench_against_vlite_serve(real_server, tmp_path, capsys):
    out = tmp_path / "real.json"
    rc = cli.main(["bench", "serve", "--base-url", real_server.url, "--api-key", real_server.api_key,
                   "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr()
    assert "Serving Benchmark Result" in text.out and "SmolLM2-135M-Instruct" in text.err  # the model's tokenizer
    saved = json.loads(out.read_text())
    s = saved["summary"]
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (4, 0, 64, 16)
    for r in saved["requests"]:
        assert r["output_tokens_from_usage"] and r["prompt_tokens"] == 16 and r["output_tokens"] == 4
        assert 0 < r["ttft"] <= r["e2e"] and r["tpot"] > 0 and 1 <= len(r["itl"]) <= 3
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms"):
        assert s[key] > 0


def test_spec_decoding_section_from_metric_deltas():
    from vlite.benchmarks.serve import format_report, spec_decoding_summary

    before = {"drafts": 10.0, "draft_tokens": 40.0, "accepted": 20.0}
    after = {"drafts": 30.0, "draft_tokens": 120.0, "accepted": 80.0}
    spec = spec_decoding_summary(before, after)
    assert spec["acceptance_rate"] == pytest.approx(60 / 80) and spec["mean_acceptance_length"] == pytest.approx(4.0)
    summary = {"completed": 1, "failed": 0, "duration": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
               "request_throughput": 1.0, "output_throughput": 1.0, "max_output_tokens_per_s": 1.0,
               "max_concurrent_requests": 1, "total_token_throughput": 2.0, "spec_decoding": spec}
    for key in ("ttft", "tpot", "itl", "e2el"):
        summary.update({f"mean_{key}_ms": 1.0, f"median_{key}_ms": 1.0, f"p99_{key}_ms": 1.0})
    text = format_report(summary, float("inf"), None, (99,))
    assert "Speculative Decoding" in text and "Acceptance length:" in text and "75.00" in text

"""The OpenAI-compatible server on the real default model, through the official client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import pid_alive, start_server, stop_server, wait_unhealthy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def model_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["id"]


# ---- official client --------------------------------------------------------------------------

def test_chat_streaming_equals_non_streaming(server, client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=model_name(server), messages=messages, max_tokens=24,
                                          temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert full.usage.completion_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + \
        full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model_name(server), messages=messages, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [choice.finish_reason]


def test_completions_logprobs_n_stop_seed(server, client):
    name = model_name(server)
    out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=8, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and chosen <= 0 and max(top.values()) >= chosen - 1e-6
    two = client.completions.create(model=name, prompt="Once upon a time", max_tokens=12, n=2, temperature=1.0,
                                    seed=7)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].text != two.choices[1].text
    stopped = client.completions.create(model=name, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0,
                                        stop=[" 8"])
    assert stopped.choices[0].finish_reason == "stop" and " 8" not in stopped.choices[0].text
    # Seeded sampling: the streamed text equals the non-streamed text.
    kwargs = dict(model=name, prompt="Write a sentence about the sea:", max_tokens=20, temperature=0.9, seed=1234)
    a = client.completions.create(**kwargs).choices[0].text
    b = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert a == b
    assert a == client.completions.create(**kwargs).choices[0].text


def test_token_id_prompts_and_tokenize(server, client):
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=server.headers).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, headers=server.headers).json()
    assert detok["prompt"] == "Hello world"
    by_ids = client.completions.create(model=model_name(server), prompt=tok["tokens"], max_tokens=5, temperature=0)
    by_text = client.completions.create(model=model_name(server), prompt="Hello world", max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    multi = client.completions.create(model=model_name(server), prompt=["a b c", "x y z"], max_tokens=3,
                                      temperature=0)
    assert sorted(c.index for c in multi.choices) == [0, 1]


# ---- raw HTTP ---------------------------------------------------------------------------------

def _events(response: httpx.Response) -> list[str]:
    body = response.read().decode()
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[len("data: "):] for e in events]


def test_sse_framing_and_usage(server):
    body = {"prompt": "Count: 1, 2,", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 6  # continuous usage grows
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, headers=server.headers) as r:
        chunks = [json.loads(e) for e in _events(r)[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in chunks)  # no stream_options: no usage field


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**7}, 400, "max_tokens"),
    ({"prompt": "hi", "n": "many"}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ({"prompt": [1, 2, 10**8]}, 400, None),
    ({"max_tokens": 3}, 400, "prompt"),
])
def test_error_statuses(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_prompt_too_long_names_both_lengths(server):
    max_len = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["max_model_len"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5] * (max_len + 10), "max_tokens": 1},
                   headers=server.headers)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(max_len) in msg and str(max_len + 10) in msg


def test_auth_and_open_routes(server):
    for path in ("/v1/models",):
        assert httpx.get(f"{server.url}{path}").status_code == 401
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{path}").status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={
        **server.headers, "Content-Type": "application/json"}).status_code == 400
    big = {"prompt": "x" * (5 * 2**20)}
    assert httpx.post(f"{server.url}/v1/completions", json=big, headers=server.headers).status_code == 413


def test_concurrent_requests_and_separate_processes(server):
    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=300, headers=server.headers) as c:
            async def one(i: int) -> dict:
                body = {"prompt": f"Request number {i}: the weather today is", "max_tokens": 8 + i % 5,
                        "ignore_eos": True, "temperature": 0.7, "seed": i}
                return (await c.post(f"{server.url}/v1/completions", json=body)).json()
            return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(run())
    for i, res in enumerate(results):
        assert res["usage"]["completion_tokens"] == 8 + i % 5, res
    engine_pid = server.engine_pid()
    assert engine_pid != server.proc.pid and pid_alive(engine_pid)
    with open(f"/proc/{engine_pid}/status") as f:
        assert f"PPid:\t{server.proc.pid}" in f.read()


def test_disconnects_abort_and_free_blocks(server):
    generated_before = server.metrics().get("vllm:generation_tokens_total", 0.0)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, headers=server.headers) as c:
            async def drop(i: int) -> None:
                body = {"prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    n = 0
                    async for _ in r.aiter_lines():
                        n += 1
                        if n >= 6:
                            break  # leaving the block closes the connection mid-stream
            await asyncio.gather(*(drop(i) for i in range(8)))

    asyncio.run(run())
    deadline = time.time() + 15
    while time.time() < deadline:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, m
    # They were cut short, not run to the end (the server is shared: count this test's tokens only).
    assert m["vllm:generation_tokens_total"] - generated_before < 8 * 400


def test_metrics_names(server):
    m = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count"):
        assert name in m, name
    assert m["vllm:request_success_total"] >= 1 and m["vllm:generation_tokens_total"] > 0


def test_engine_death_fails_requests_and_exits(tmp_path_factory):
    srv = start_server(tmp_path_factory, "--max-num-seqs", "4")
    try:
        # Without --trust-request-chat-template a request may not bring its own template.
        r = httpx.post(f"{srv.url}/v1/chat/completions", headers=srv.headers, json={
            "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages[0].content }}"})
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "chat_template"
        engine_pid = srv.engine_pid()
        body = {"prompt": "A long story:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engine_pid, signal.SIGKILL)
            t0 = time.time()
            rest = list(lines)  # must end (with an error event), not hang
        assert any('"error"' in line for line in rest), rest[-3:]
        assert time.time() - t0 < 10
        assert wait_unhealthy(srv) != 200 and time.time() - t0 < 3
        assert srv.proc.wait(30) != 0  # the server exits non-zero so a supervisor restarts it
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_request_raising_in_engine_fails_alone(tmp_path_factory):
    poison = 49151  # VLITE_FAULT_INJECT_TOKEN_ID: the runner raises in any step computing it
    srv = start_server(tmp_path_factory, env={"VLITE_FAULT_INJECT_TOKEN_ID": str(poison)})

    async def stream_text(client: httpx.AsyncClient, prompt: str) -> tuple[str, list[dict]]:
        body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
        events = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events

    async def scenario():
        async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers, timeout=120) as client:
            prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
            alone = [(await stream_text(client, p))[0] for p in prompts]
            streams = [asyncio.create_task(stream_text(client, p)) for p in prompts]
            await asyncio.sleep(0.5)  # they are decoding now; the poisoned requests join their batch
            bad = {"prompt": [504, 3458, poison, 30], "max_tokens": 8}
            r_plain = await client.post("/v1/completions", json=bad)
            async with client.stream("POST", "/v1/completions", json={**bad, "stream": True}) as r:
                bad_lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            together = await asyncio.gather(*streams)
            return alone, together, r_plain, bad_lines

    try:
        alone, together, r_plain, bad_lines = asyncio.run(scenario())
        assert r_plain.status_code == 500, r_plain.text
        assert "injected fault" in r_plain.json()["error"]["message"]
        assert any('"error"' in line for line in bad_lines), bad_lines
        for (text, events), text_alone in zip(together, alone):
            assert not any("error" in e for e in events)
            assert text == text_alone  # greedy, float32: the same 40 tokens as when run alone
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        m = srv.metrics()
        assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
        log = open(srv.log_path).read()
        assert "alone to find the one that fails" in log  # the fault hit a batch, not a lone request
    finally:
        assert stop_server(srv) == 0


def test_serve_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "vlite", "serve", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--kv-cache-memory", "--dtype", "--seed",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--scheduling-policy", "--chat-template",
                 "--uvicorn-log-level", "--max-request-body-bytes", "--quantization", "--tool-call-parser",
                 "--enable-auto-tool-choice", "--lora-modules"):
        assert flag in out, flag


"""`vlite serve --kv-offload-dir` across a real restart: the second server process loads the prompt's KV
blocks the first one stored, answers the same, and counts them as external prefix-cache hits."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import Server, start_server, stop_server

PROMPT = ("The lighthouse keeper wrote in his log every night: the wind, the ships that passed, the colour of "
          "the sea at dusk and the names of the birds that rested on the gallery rail. ") * 4


def wait_ready(server: Server, timeout: float = 180) -> None:
    """Until the model is served (/v1/models answers), not only the process up."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not serve /v1/models in time")


def complete(server: Server) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_restart_reuses_the_stored_prefix(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kv-store"))
    args = ("--kv-offload-dir", store, "--kv-offload-size", "0.25", "--max-num-batched-tokens", "128")
    first = start_server(tmp_path_factory, *args)
    try:
        wait_ready(first)
        before = complete(first)
        assert first.metrics()["vllm:external_prefix_cache_hits_total"] == 0
    finally:
        assert stop_server(first) == 0  # a clean stop writes what is pending
    second = start_server(tmp_path_factory, *args)
    try:
        wait_ready(second)
        after = complete(second)
        metrics = second.metrics()
    finally:
        assert stop_server(second) == 0
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    prompt_tokens = after["usage"]["prompt_tokens"]
    assert metrics["vllm:external_prefix_cache_hits_total"] == (prompt_tokens - 1) // 16 * 16
    assert metrics["vllm:external_prefix_cache_queries_total"] == prompt_tokens

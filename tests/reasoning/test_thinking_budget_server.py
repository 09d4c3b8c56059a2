"""`vlite serve --reasoning-parser qwen3 --reasoning-budget 1` on the tiny thinking model, through the openai
client: the server's budget for requests that set none, a request's own thinking_token_budget (vLLM's extra
parameter) over it, streamed and not, and a bad budget as a 400 naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import start_server, stop_server
from tests.reasoning import thinking_model as tm
from tests.reasoning.test_reasoning_server import ASK, both


@pytest.fixture(scope="module")
def server(tmp_path_factory, thinking_model_dir):
    srv = start_server(tmp_path_factory, "--model", str(thinking_model_dir), "--reasoning-parser", "qwen3",
                       "--reasoning-budget", "1", "--kv-cache-memory", "8MiB", "--max-model-len", "256")
    yield srv
    assert stop_server(srv) == 0, open(srv.log_path).read()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def test_server_budget_and_request_budget(client) -> None:
    assert both(client)[:2] == ("\nPonder", tm.ANSWER)  # --reasoning-budget 1
    assert both(client, extra_body={"thinking_token_budget": 2})[:2] == ("\nPonder" + tm.DECOY, tm.ANSWER)
    assert both(client, extra_body={"thinking_token_budget": 0})[:2] == (None, tm.ANSWER)  # "<think></think>"
    assert both(client, extra_body={"thinking_token_budget": 50})[:2] == (tm.REASONING, tm.ANSWER)


def test_bad_budget_names_the_field(server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers,
                   json={"messages": ASK, "max_tokens": 2, "thinking_token_budget": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text

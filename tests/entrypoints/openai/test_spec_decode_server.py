"""`vlite serve --speculative-config`: same greedy answers as the plain server, vLLM's spec-decode
counters on /metrics, and a bad config refused before the model loads."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.openai.conftest import start_server, stop_server
from vlite.engine.arg_utils import EngineArgs

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def _chat(srv, text: str, stream: bool = False) -> str:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 48,
            "temperature": 0.0, "stream": stream}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    parts = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            delta = json.loads(line[6:])["choices"][0]["delta"]
            parts.append(delta.get("content") or "")
    return "".join(parts)


def test_spec_server_matches_plain_server(tmp_path_factory, server):
    text = "Repeat exactly: red green blue, red green blue, red green blue, red green blue."
    plain = _chat(server, text)
    srv = start_server(tmp_path_factory, "--speculative-config", json.dumps(SPEC))
    try:
        assert _chat(srv, text) == plain
        assert _chat(srv, text, stream=True) == plain
        m = srv.metrics()
        assert m["vllm:spec_decode_num_drafts_total"] > 0
        assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
        accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
        assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
    finally:
        assert stop_server(srv) == 0


def test_bad_speculative_config_refused_before_loading():
    with pytest.raises(ValueError, match=r"speculative_config.num_speculative_tokens must be an integer in \[1, 16\]"):
        EngineArgs(model="/nonexistent", speculative_config='{"method": "ngram", "num_speculative_tokens": 99}'
                   ).create_engine_config()

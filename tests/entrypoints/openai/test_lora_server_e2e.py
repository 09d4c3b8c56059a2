"""LoRA through a real `vlite serve --enable-lora` on the default model: an adapter given at start-up is a model
of /v1/models and changes what `model: "<adapter>"` generates; adapters loaded and unloaded at runtime while a
request under another adapter streams, a bad folder refused (400) with nothing else affected; the metric."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.conftest import start_server, stop_server

PROMPT = "The three most useful kitchen tools are"


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    from vlite.benchmarks.lora import MODULES, write_random_adapter
    from vlite.model_loader import load_model_arch
    from vlite.model_loader.resolve import resolve_model

    cfg = load_model_arch(resolve_model(None), torch.float32)
    root = tmp_path_factory.mktemp("server_adapters")
    return {name: write_random_adapter(root / name, cfg, 8, MODULES["all"], seed=i, b_scale=0.05)
            for i, name in enumerate(("static", "runtime"))}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory, adapter_dirs: dict[str, Path]):
    srv = start_server(tmp_path_factory, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                       "--max-model-len", "1024", "--lora-modules", f"static={adapter_dirs['static']}",
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield srv
    assert stop_server(srv) == 0


def complete(srv, model: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=120,
                      json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": 1})


def test_adapters_are_models(lora_server, adapter_dirs: dict[str, Path]) -> None:
    cards = httpx.get(f"{lora_server.url}/v1/models", headers=lora_server.headers, timeout=10).json()["data"]
    base = cards[0]["id"]
    static = next(c for c in cards if c["id"] == "static")
    assert static["parent"] == base and static["root"] == str(adapter_dirs["static"])
    out_base, out_static = complete(lora_server, base), complete(lora_server, "static")
    assert out_base.status_code == out_static.status_code == 200
    assert out_static.json()["model"] == "static"
    # the adapter (a small update: the same words here) moves every logprob; the same request again: the same
    logprobs = lambda r: r.json()["choices"][0]["logprobs"]["token_logprobs"]  # noqa: E731
    assert all(a != b for a, b in zip(logprobs(out_static), logprobs(out_base)))
    assert logprobs(complete(lora_server, "static")) == logprobs(out_static)
    assert complete(lora_server, "nonexistent").status_code == 404


def test_runtime_load_and_unload_while_another_adapter_streams(lora_server, adapter_dirs: dict[str, Path],
                                                               tmp_path: Path) -> None:
    srv = lora_server
    pieces: list[str] = []
    finish: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", headers=srv.headers, timeout=120,
                          json={"model": "static", "prompt": PROMPT, "max_tokens": 64, "temperature": 0,
                                "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    pieces.append(choice["text"])
                    if choice.get("finish_reason"):
                        finish.append(choice["finish_reason"])

    t = threading.Thread(target=stream)
    t.start()
    post = lambda route, body: httpx.post(f"{srv.url}/v1/{route}", headers=srv.headers, json=body, timeout=60)  # noqa: E731
    assert post("load_lora_adapter", {"lora_name": "runtime", "lora_path": str(adapter_dirs["runtime"])}
                ).status_code == 200
    bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and "bad" in bad.text
    assert complete(srv, "runtime").status_code == 200
    assert post("unload_lora_adapter", {"lora_name": "runtime"}).status_code == 200
    assert complete(srv, "runtime").status_code == 404
    t.join(120)
    assert finish == ["length"] and len("".join(pieces)) > 0
    ids = [c["id"] for c in httpx.get(f"{srv.url}/v1/models", headers=srv.headers, timeout=10).json()["data"]]
    assert "static" in ids and "runtime" not in ids and "bad" not in ids
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert "vllm:lora_requests_info{" in text and 'max_lora="2"' in text

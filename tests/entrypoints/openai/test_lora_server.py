"""The OpenAI server's LoRA plumbing (serving_models.py) over a fake engine: adapters listed as models, `model:
"<adapter>"` reaching the engine as a LoRARequest, vLLM's 404 for an unknown model, and the runtime load/unload
routes (gated by VLLM_ALLOW_RUNTIME_LORA_UPDATING), a bad one failing alone while another request streams.

The fake engine has AsyncLLM's surface the handlers use; it records each request's adapter. The real engine's
end-to-end server test lives with the engine's LoRA tests.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Optional

import httpx
import pytest

from vlite.entrypoints.openai.api_server import EngineHolder, build_app
from vlite.entrypoints.openai.serving_engine import OpenAIError
from vlite.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels
from vlite.lora.peft_adapter import LoRAAdapterError
from vlite.lora.request import LoRARequest
from vlite.outputs import CompletionOutput, RequestOutput
from vlite.sampling_params import RequestOutputKind

BASE = "base-model"


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return "".join(m["content"] for m in messages)


class FakeEngine:
    """Generates "Hello from <adapter or base>" in three deltas (or one final output); `gate`, when set, holds each request after
    its first delta. add_lora refuses a folder without adapter_config.json, as the PEFT reader does."""

    model_name = "org/base"
    max_model_len = 128
    vocab_size = 50
    runner = "generate"
    is_running = True
    errored = None

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.requests: list[tuple[str, Optional[LoRARequest]]] = []  # (request id, adapter) of process_inputs
        self.loaded: dict[int, LoRARequest] = {}
        self.gate: Optional[asyncio.Event] = None
        self.first_delta = asyncio.Event()

    def num_unfinished_requests(self) -> int:
        return 0

    def process_inputs(self, request_id: str, prompt: dict[str, Any], params: Any, priority: int = 0,
                       lora_request: Optional[LoRARequest] = None) -> tuple[Optional[str], Any]:
        self.requests.append((request_id, lora_request))
        return prompt["prompt"], SimpleNamespace(request_id=request_id, lora_request=lora_request, params=params)

    async def generate(self, engine_input: tuple[Optional[str], Any]) -> AsyncIterator[RequestOutput]:
        request = engine_input[1]
        words = ["Hello", " from", " " + (request.lora_request.lora_name if request.lora_request else "base")]
        if request.params.output_kind == RequestOutputKind.FINAL_ONLY:  # a non-streaming response's one output
            words = ["", "", "".join(words)]
        for i, word in enumerate(words):
            if i == 1:
                self.first_delta.set()
                if self.gate is not None:
                    await self.gate.wait()
            last = i == len(words) - 1
            yield RequestOutput(request.request_id, None, [], [CompletionOutput(0, word, [i + 1],
                                finish_reason="stop" if last else None)], last)

    async def add_lora(self, lora: LoRARequest) -> bool:
        if not (Path(lora.lora_path) / "adapter_config.json").is_file():
            raise LoRAAdapterError(lora.lora_path, "no adapter_config.json (not a PEFT adapter folder)")
        self.loaded[lora.lora_int_id] = lora
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.loaded.pop(lora_int_id, None) is not None

    async def list_loras(self) -> set[int]:
        return set(self.loaded)

    def shutdown(self) -> None:
        pass


def adapter_dir(tmp_path: Path, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    return str(folder)


async def make_client(tmp_path: Path, allow_runtime: bool = False, *adapters: str
                      ) -> tuple[httpx.AsyncClient, FakeEngine]:
    engine = FakeEngine()
    models = OpenAIServingModels(engine, [BASE, "alias"],
                                 [LoRAModulePath(a, adapter_dir(tmp_path, a)) for a in adapters])
    await models.init_static_loras()
    holder = EngineHolder(served_model_names=[BASE, "alias"])
    holder.set(engine, models=models)  # type: ignore[arg-type]
    app = build_app(holder, allow_runtime_lora_updating=allow_runtime)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test"), engine


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_models_lists_adapters_with_parent(tmp_path):
    async def main() -> None:
        client, engine = await make_client(tmp_path, False, "sql", "chat")
        async with client:
            data = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == [BASE, "alias", "sql", "chat"]
        base, sql = data[0], data[2]
        assert base["root"] == "org/base" and base["parent"] is None and base["max_model_len"] == 128
        assert sql["root"] == str(tmp_path / "sql") and sql["parent"] == BASE and sql["object"] == "model"
        # Registered at start-up with ids 1, 2 and loaded through the engine.
        assert {i: r.lora_name for i, r in engine.loaded.items()} == {1: "sql", 2: "chat"}

    run(main())


def test_model_selects_the_adapter(tmp_path):
    async def main() -> None:
        client, engine = await make_client(tmp_path, False, "sql", "chat")
        async with client:
            r = await client.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 5})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "sql" and r.json()["choices"][0]["text"] == "Hello from sql"
            assert engine.requests[-1][1] == LoRARequest("sql", 1, str(tmp_path / "sql"))
            assert engine.requests[-1][1].lora_int_id == 1

            body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.json()["model"] == "chat" and r.json()["choices"][0]["message"]["content"] == "Hello from chat"
            assert engine.requests[-1][1].lora_int_id == 2

            r = await client.post("/v1/chat/completions", json={**body, "stream": True})
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert {c["model"] for c in chunks} == {"chat"}
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
                "Hello from chat"

            r = await client.post("/v1/completions", json={"model": "sql", "prompt": ["a", "b"], "max_tokens": 5,
                                                           "stream": True})
            assert r.status_code == 200 and {c[1].lora_name for c in engine.requests[-2:]} == {"sql"}

            # The base model, by any served name or none: no adapter, the first name echoed (as vLLM).
            for model in (BASE, "alias", None):
                r = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 5})
                assert r.json()["model"] == BASE and r.json()["choices"][0]["text"] == "Hello from base"
                assert engine.requests[-1][1] is None

    run(main())


def test_unknown_model_is_404_and_adapters_are_not_for_pooling(tmp_path):
    async def main() -> None:
        client, _ = await make_client(tmp_path, False, "sql")
        async with client:
            for path, body in (("/v1/completions", {"prompt": "hi"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                r = await client.post(path, json={"model": "nope", **body})
                assert r.status_code == 404
                assert r.json() == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                              "param": "model", "code": 404}}
            r = await client.post("/v1/embeddings", json={"model": "sql", "input": "hi"})
            assert r.status_code == 400 and "LoRA adapter" in r.json()["error"]["message"]
            # /tokenize takes an adapter's name (one tokenizer for all).
            r = await client.post("/tokenize", json={"model": "sql", "prompt": "hi"})
            assert r.status_code == 200 and r.json()["count"] == 2

    run(main())


def test_runtime_routes_are_404_unless_enabled(tmp_path, monkeypatch):
    async def main(allow: Optional[bool]) -> list[int]:
        client, _ = await make_client(tmp_path / str(allow), allow)
        async with client:
            return [(await client.post(path, json={"lora_name": "x", "lora_path": "/nowhere"})).status_code
                    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")]

    for allow in (None, False, True):
        (tmp_path / str(allow)).mkdir()
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert run(main(None)) == [404, 404]
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert run(main(None)) == [404, 404]
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "TRUE")
    assert run(main(None)) == [400, 404]  # the routes exist: a missing folder, an unknown name
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert run(main(False)) == [404, 404]  # an explicit argument wins over the environment
    assert run(main(True)) == [400, 404]


def test_load_and_unload_at_runtime(tmp_path):
    async def main() -> None:
        client, engine = await make_client(tmp_path, True, "sql")
        path = adapter_dir(tmp_path, "new")
        async with client:
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": path})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' added successfully."
            assert engine.loaded[2].lora_name == "new"
            models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            assert models == [BASE, "alias", "sql", "new"]
            r = await client.post("/v1/completions", json={"model": "new", "prompt": "hi"})
            assert r.json()["choices"][0]["text"] == "Hello from new"

            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": path})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == "The lora adapter 'new' has already been loaded."
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": path})
            assert r.status_code == 400 and "served model name" in r.json()["error"]["message"]
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"

            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' removed successfully."
            assert 2 not in engine.loaded
            r = await client.post("/v1/completions", json={"model": "new", "prompt": "hi"})
            assert r.status_code == 404
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
            assert r.status_code == 404
            assert r.json()["error"] == {"message": "The lora adapter 'new' cannot be found.",
                                         "type": "NotFoundError", "param": "lora_name", "code": 404}
            r = await client.post("/v1/unload_lora_adapter", json={})
            assert r.status_code == 400
            # By id alone; ids are never reused, so reloading a name gets a fresh one.
            r = await client.post("/v1/unload_lora_adapter", json={"lora_int_id": 1})
            assert r.status_code == 200 and engine.loaded == {}
            await client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path})
            assert list(engine.loaded) == [3]

    run(main())


def test_bad_load_fails_alone_while_a_request_streams(tmp_path):
    async def main() -> None:
        client, engine = await make_client(tmp_path, True, "sql")
        engine.gate = asyncio.Event()
        async with client:
            stream = asyncio.create_task(client.post("/v1/completions", json={
                "model": "sql", "prompt": "hi", "stream": True}))
            await asyncio.wait_for(engine.first_delta.wait(), 10)  # the stream is mid-generation

            bad = tmp_path / "not-an-adapter"
            bad.mkdir()
            for path in (str(bad), str(tmp_path / "missing")):
                r = await client.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": path})
                assert r.status_code == 400
                message = r.json()["error"]["message"]
                assert "'broken'" in message and path in message and "adapter_config.json" in message
            assert not stream.done()

            engine.gate.set()
            r = await asyncio.wait_for(stream, 10)
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello from sql"
            assert r.text.rstrip().endswith("data: [DONE]")
            # Nothing else changed: the registered adapter still serves, the bad name is not registered.
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [BASE, "alias", "sql"]
            assert list(engine.loaded) == [1]
            r = await client.post("/v1/completions", json={"model": "broken", "prompt": "hi"})
            assert r.status_code == 404

    run(main())


def test_concurrent_loads_get_distinct_ids(tmp_path):
    async def main() -> None:
        engine = FakeEngine()
        models = OpenAIServingModels(engine, [BASE])
        paths = [adapter_dir(tmp_path, f"a{i}") for i in range(6)]
        await asyncio.gather(*(models.load_lora_adapter(f"a{i}", p) for i, p in enumerate(paths)),
                             *(models.load_lora_adapter("a0", paths[0]) for _ in range(3)), return_exceptions=True)
        assert sorted(models.lora_requests) == [f"a{i}" for i in range(6)]
        ids = [r.lora_int_id for r in models.lora_requests.values()]
        assert len(set(ids)) == 6 and set(engine.loaded) == set(ids)

    run(main())


def test_bad_static_adapter_fails_start_up_naming_it(tmp_path):
    async def main() -> None:
        models = OpenAIServingModels(FakeEngine(), [BASE], [LoRAModulePath("good", adapter_dir(tmp_path, "good")),
                                                            LoRAModulePath("bad", str(tmp_path / "nowhere"))])
        with pytest.raises(ValueError, match=r"--lora-modules: Failed to load LoRA adapter 'bad': .*nowhere.*"
                                             r"adapter_config\.json"):
            await models.init_static_loras()

    run(main())


def test_engine_refusal_without_the_path_still_names_it(tmp_path):
    class NoLoRAEngine(FakeEngine):
        async def add_lora(self, lora: LoRARequest) -> bool:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora")

    async def main() -> None:
        models = OpenAIServingModels(NoLoRAEngine(), [BASE])
        path = adapter_dir(tmp_path, "a")
        with pytest.raises(OpenAIError) as exc:
            await models.load_lora_adapter("a", path)
        assert exc.value.status == 400 and exc.value.param == "lora_path"
        assert exc.value.message == f"Failed to load LoRA adapter 'a' (from {path}): LoRA is not enabled: start " \
                                    "the engine with --enable-lora"
        assert models.lora_requests == {}

    run(main())

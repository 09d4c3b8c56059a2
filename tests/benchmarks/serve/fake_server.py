"""A tiny fake OpenAI server for `vlite bench serve` (FastAPI, streaming fake chunks with small sleeps; no model).

The request's `model` picks a behaviour: `fail-http` (400), `fail-stream` (an error event after the first
token), `no-done` (no `data: [DONE]`), `no-usage` (no usage chunk); any other name streams normally.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FAKE_KEY = "fake-key"
FIRST_DELAY = 0.05  # before the first token
TOKEN_DELAY = 0.01  # between tokens


def fake_app(received: list) -> FastAPI:
    """The app; every streamed request's body is appended to `received`."""
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

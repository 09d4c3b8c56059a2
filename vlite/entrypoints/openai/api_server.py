"""`vlite serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM.

The API process handles HTTP, tokenization and detokenization; the engine core runs in a child
process. Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /version, /metrics,
/tokenize, /detokenize; a pooling model's /v1/embeddings, /pooling, /score, /rerank (serving_embedding.py,
serving_score.py); LoRA adapters as models, and with VLLM_ALLOW_RUNTIME_LORA_UPDATING /v1/load_lora_adapter and
/v1/unload_lora_adapter (serving_models.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlite.config import ReasoningConfig
from vlite.engine.arg_utils import EngineArgs
from vlite.engine.async_llm import AsyncLLM, EngineGenerateError
from vlite.engine.core_client import EngineDeadError
from vlite.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                               EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest,
                                               TokenizeRequest)
from vlite.entrypoints.openai.middleware import AdmissionCount, BodyLimit, error_response
from vlite.entrypoints.openai.serving_chat import OpenAIServingChat
from vlite.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vlite.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from vlite.entrypoints.openai.serving_engine import OpenAIError, new_tokenizer_pool
from vlite.entrypoints.openai.serving_models import (LoRAModulePath, OpenAIServingModels, add_lora_routes,
                                                     check_lora_modules, runtime_lora_updating_allowed)
from vlite.entrypoints.openai.serving_score import OpenAIServingScore

logger = logging.getLogger("vlite")

# Routes that stay open when an API key is set: probes and the schema.
_OPEN_PATHS = {"/health", "/metrics", "/version", "/ping", "/openapi.json", "/docs", "/docs/oauth2-redirect"}


def _is_type_tag(loc_item: str) -> bool:
    """pydantic names the alternatives of a union in an error's location by their types."""
    return loc_item in ("str", "int", "float", "bool", "none", "list", "dict") or "[" in loc_item \
        or loc_item.startswith("function-")


async def _listen_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next message is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run a non-streaming handler, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    finally:
        watcher.cancel()


class EngineHolder:
    """The engine once it is ready: the server listens (and answers 503) while the model loads."""

    def __init__(self, engine: Optional[AsyncLLM] = None, served_model_names: Optional[list[str]] = None) -> None:
        self.engine: Optional[AsyncLLM] = None
        self.completion: Optional[OpenAIServingCompletion] = None
        self.chat: Optional[OpenAIServingChat] = None
        self.embedding: Optional[OpenAIServingEmbedding] = None  # the pooling routes
        self.score: Optional[OpenAIServingScore] = None
        self.models: Optional[OpenAIServingModels] = None  # base model names and LoRA adapters
        self.served_model_names = served_model_names or []
        self.load_error: Optional[str] = None
        if engine is not None:
            self.set(engine)

    def set(self, engine: AsyncLLM, log_prompts: bool = False, trust_request_chat_template: bool = False,
            tool_call_parser: Optional[str] = None, enable_auto_tool_choice: bool = False,
            models: Optional[OpenAIServingModels] = None,
            default_chat_template_kwargs: Optional[dict[str, Any]] = None) -> None:
        """`models`: the registry with the --lora-modules adapters already loaded; default: the base model only."""
        pool = new_tokenizer_pool()  # one tokenizer thread for all handlers
        models = models or OpenAIServingModels(engine, self.served_model_names)
        self.models = models
        self.completion = OpenAIServingCompletion(engine, models, log_prompts, pool)
        self.chat = OpenAIServingChat(engine, models, log_prompts, trust_request_chat_template, tool_call_parser,
                                      enable_auto_tool_choice, pool, default_chat_template_kwargs)
        self.embedding = OpenAIServingEmbedding(engine, models, log_prompts, pool)
        self.score = OpenAIServingScore(engine, models, log_prompts, pool)
        self.engine = engine  # last: the routes take a set engine to mean the handlers are there

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_running

    def require(self) -> tuple[AsyncLLM, OpenAIServingCompletion, OpenAIServingChat]:
        if self.engine is None or self.completion is None or self.chat is None:
            raise OpenAIError(f"the engine is not ready: {self.load_error or 'the model is still loading'}", 503)
        if not self.engine.is_running:
            raise OpenAIError(f"the engine is not available: {self.engine.errored or 'not running'}", 503)
        return self.engine, self.completion, self.chat


def build_app(holder: EngineHolder, api_key: Optional[str] = None, max_request_body_bytes: int = 4 * 2**20,
              stat_logger: Any = None, lifespan: Optional[Callable] = None,
              max_pending_requests: Optional[int] = None,
              allow_runtime_lora_updating: Optional[bool] = None) -> FastAPI:
    """`allow_runtime_lora_updating`: add the LoRA load/unload routes; default: VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    from vlite import __version__

    app = FastAPI(title="vlite", version=__version__, lifespan=lifespan)
    app.state.holder = holder

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            loc = first.get("loc", ())
            pos = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
            return error_response(OpenAIError(f"the request body is not valid JSON: "
                                      f"{(first.get('ctx') or {}).get('error', 'decode error')}{pos}", 400))
        loc = [str(x) for x in first.get("loc", ())][1:]  # past "body"
        tag_at = next((i for i, x in enumerate(loc) if _is_type_tag(x)), None)
        if tag_at is None:
            param = ".".join(loc) or None
            msg = str(first.get("msg", "invalid value"))
        else:
            # A union field (e.g. prompt: a string, a list of strings or of token ids) reports one
            # error per alternative, under the alternative's type: name the field and the alternatives.
            param = ".".join(loc[:tag_at]) or None
            tags: list[str] = []
            for e in errors:
                e_loc = [str(x) for x in e.get("loc", ())][1:]
                if e_loc[:tag_at] == loc[:tag_at] and len(e_loc) > tag_at and e_loc[tag_at] not in tags \
                        and not e_loc[tag_at].startswith("function"):
                    tags.append(e_loc[tag_at])
            msg = f"invalid value; expected one of: {', '.join(tags)}"
        message = f"{param}: {msg}" if param else msg
        return error_response(OpenAIError(message, 400, param))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(OpenAIError(f"the engine is not available: {exc}", 503))

    @app.exception_handler(EngineGenerateError)
    async def _generate_failed(request: Request, exc: EngineGenerateError) -> JSONResponse:
        return error_response(OpenAIError(f"the request failed in the engine: {exc}", 500))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own errors (unknown route, wrong method, an unreadable body) in OpenAI's shape.
        message = str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message = f"the request body is not valid UTF-8: {exc.__cause__}"
        return error_response(OpenAIError(message, exc.status_code), exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault; logged with its traceback by uvicorn. Still OpenAI's shape.
        return error_response(OpenAIError(f"internal server error: {type(exc).__name__}", 500))

    admission = AdmissionCount()
    app.add_middleware(AdmissionCount.Middleware, counter=admission)
    # Added before the auth guard below, so it runs inside it: unauthenticated bodies are never read.
    app.add_middleware(BodyLimit, limit=max_request_body_bytes)

    @app.middleware("http")
    async def _guard(request: Request, call_next: Callable) -> Response:
        path = request.url.path
        if api_key and path not in _OPEN_PATHS:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                return error_response(OpenAIError(
                    "Unauthorized: a valid API key is required (Authorization: Bearer <key>)", 401))
        return await call_next(request)

    def admit(request: Request) -> tuple[AsyncLLM, OpenAIServingCompletion, OpenAIServingChat]:
        """Overload guard: beyond the pending-request cap, 503 with Retry-After instead of queueing.

        Counts admitted HTTP requests until their response is over (AdmissionCount), not the
        engine's requests: those are registered only once the handler's work starts, so a burst
        would all pass a check against them. Check and count happen with no await in between.
        """
        engine, completion, chat = holder.require()
        if max_pending_requests is not None:
            pending = max(admission.pending, engine.num_unfinished_requests())
            if pending >= max_pending_requests:
                raise OpenAIError(f"the server is overloaded ({pending} requests pending, limit "
                                  f"{max_pending_requests}); retry later", 503)
            admission.admit(request.scope)
        return engine, completion, chat

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if holder.is_ready else 503)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(stat_logger.registry) if stat_logger is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def models() -> OpenAIServingModels:
        holder.require()
        assert holder.models is not None  # set with the engine
        return holder.models

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        engine, _, _ = holder.require()
        return models().show_available_models(engine.model_name, engine.max_model_len)

    if runtime_lora_updating_allowed() if allow_runtime_lora_updating is None else allow_runtime_lora_updating:
        add_lora_routes(app, models)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _, completion, _ = admit(request)
        completion.check_runner("generate")
        return await _respond(request, body.stream, await completion.create_completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        _, _, chat = admit(request)
        chat.check_runner("generate")
        return await _respond(request, body.stream, await chat.create_chat_completion(body))

    def pooling(request: Request) -> tuple[OpenAIServingEmbedding, OpenAIServingScore]:
        admit(request)
        assert holder.embedding is not None and holder.score is not None  # set with the engine
        return holder.embedding, holder.score

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await _respond(request, False, pooling(request)[0].create_embedding(body))

    @app.post("/pooling")
    async def pool(body: PoolingRequest, request: Request) -> Any:
        return await _respond(request, False, pooling(request)[0].create_pooling(body))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Any:
        return await _respond(request, False, pooling(request)[1].create_score(body))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Any:
        return await _respond(request, False, pooling(request)[1].create_rerank(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        engine, _, chat = holder.require()
        chat.check_model(body.model)
        if body.messages is not None:
            _, tokens = await chat.run_tokenizer(chat.render_chat, body)
        elif body.prompt is not None:
            tokens = await chat.run_tokenizer(
                lambda: engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            raise OpenAIError("either prompt or messages is required", 400, "prompt")
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        engine, completion, _ = holder.require()
        completion.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise OpenAIError(f"tokens contains ids outside the vocabulary [0, {engine.vocab_size}): {bad[:5]}", 400,
                              "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app


async def _respond(request: Request, stream: bool, result: Any) -> Any:
    """A generation handler's result: an SSE stream, or the JSON body once done (cancelled if the client leaves)."""
    if stream:
        return StreamingResponse(result, media_type="text/event-stream")
    return await _cancel_on_disconnect(request, _as_json(result))


async def _as_json(result: Any) -> Any:
    return JSONResponse(await result) if asyncio.iscoroutine(result) else JSONResponse(result)


def _make_server_class() -> type:
    import uvicorn

    class _Server(uvicorn.Server):
        """SIGINT/SIGTERM: stop accepting, let in-flight requests finish (5 s), stop the engine, exit 0.

        (uvicorn itself re-raises the signal after its graceful shutdown, which would make a clean
        stop look like a crash to a supervisor.)
        """

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return _Server


def run_server(engine_args: EngineArgs, host: str, port: int, served_model_name: Optional[list[str]],
               api_key: Optional[str], uvicorn_log_level: str = "info",
               max_request_body_bytes: int = 4 * 2**20, max_waiting_requests: int = 1024,
               log_prompts: bool = False, trust_request_chat_template: bool = False,
               tool_call_parser: Optional[str] = None, enable_auto_tool_choice: bool = False,
               lora_modules: Optional[list[LoRAModulePath]] = None,
               default_chat_template_kwargs: Optional[dict[str, Any]] = None) -> int:
    """Listen at once (answering 503 while the model loads, and its --lora-modules adapters); exit non-zero if
    the engine dies, or fails to start or to load an adapter."""
    import uvicorn

    from vlite.entrypoints.openai.tool_parsers import ToolParserManager

    if tool_call_parser is not None:
        ToolParserManager.get_tool_parser(tool_call_parser)  # an unknown name fails before the model loads
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    ReasoningConfig.from_user(engine_args.reasoning_parser, engine_args.reasoning_config)  # before the model loads

    from vlite.metrics import PrometheusStatLogger
    from vlite.model_loader import resolve_model

    _Server = _make_server_class()
    api_key = api_key or os.environ.get("VLITE_API_KEY") or None
    names = served_model_name or [engine_args.model or Path(resolve_model(None).name).stem]
    check_lora_modules(lora_modules or [], names)  # before the model loads
    stat_logger = PrometheusStatLogger(names[0])
    holder = EngineHolder(served_model_names=names)
    failed = False

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if holder.engine is not None:
            holder.engine.shutdown()

    async def main() -> None:
        nonlocal failed
        app = build_app(holder, api_key, max_request_body_bytes, stat_logger, lifespan,
                        max_pending_requests=engine_args.max_num_seqs + max_waiting_requests)
        server = _Server(uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                                        timeout_graceful_shutdown=5))

        async def load_and_watch() -> None:
            nonlocal failed
            try:
                engine = await AsyncLLM.create(engine_args, stat_loggers=[stat_logger])
            except Exception as e:
                holder.load_error = str(e)
                logger.error("vlite: the engine failed to start: %s", e)
                failed, server.should_exit = True, True
                return
            models = OpenAIServingModels(engine, names, lora_modules)
            try:
                await models.init_static_loras()
            except ValueError as e:
                holder.load_error = str(e)
                logger.error("vlite: %s", e)
                engine.shutdown()
                failed, server.should_exit = True, True
                return
            holder.set(engine, log_prompts, trust_request_chat_template, tool_call_parser, enable_auto_tool_choice,
                       models, default_chat_template_kwargs)
            logger.warning("vlite: serving %s at http://%s:%d (API pid %d, engine core pid %s); try:\n"
                           "  curl http://%s:%d/v1/chat/completions -H 'Content-Type: application/json' "
                           "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'",
                           names[0], host, port, os.getpid(), engine.engine_pid, host, port)
            # If the engine core dies, every in-flight request has already failed with an error; exit
            # non-zero so a supervisor restarts the whole server (see docs/reliability.md).
            while engine.is_running:
                await asyncio.sleep(0.25)
            logger.error("vlite: the engine core died (%s); shutting down",
                         engine.errored or f"exit code {engine.client.proc.exitcode}")
            failed = True
            await asyncio.sleep(0.5)
            server.should_exit = True

        task = asyncio.create_task(load_and_watch())
        try:
            await server.serve()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if holder.engine is not None:
                holder.engine.shutdown()

    asyncio.run(main())
    return 1 if failed else 0

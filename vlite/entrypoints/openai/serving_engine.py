"""What the completions and chat handlers share: validation of a prompt against the model's limits,
the engine requests it becomes, the SSE stream around a handler's chunks, usage and OpenAI errors."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, TypeVar

from vlite.engine.async_llm import AsyncLLM, EngineBadRequestError
from vlite.entrypoints.openai.protocol import StreamOptions
from vlite.entrypoints.openai.structured_outputs import constraint_field
from vlite.entrypoints.openai.tool_parsers import ToolParser
from vlite.harmony import HarmonyParser
from vlite.lora.request import LoRARequest
from vlite.outputs import Logprob, RequestOutput
from vlite.reasoning import ReasoningParser

if TYPE_CHECKING:
    from vlite.entrypoints.openai.serving_models import OpenAIServingModels

T = TypeVar("T")

logger = logging.getLogger("vlite")


class OpenAIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's error shape."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             405: "MethodNotAllowedError", 413: "BadRequestError", 503: "ServiceUnavailableError",
             500: "InternalServerError"}

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "BadRequestError"),
                          "param": self.param, "code": self.status}}


# Characters that json.dumps(ensure_ascii=False) leaves raw but that line splitters treat as line
# ends (str.splitlines, and httpx's aiter_lines built on it): a generated U+2028 would cut an SSE
# event in two for such clients. Escaped, the JSON decodes to the same text.
_SSE_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False).translate(_SSE_LINE_BREAKS)}\n\n"


@dataclass
class Prepared:
    """One prompt of a request, validated and tokenized."""

    text: Optional[str]
    token_ids: list[int]
    request_id: str
    engine_input: Any = None
    # The request field of its structured-output constraint (a compile error is a 400 naming it).
    constraint_field: Optional[str] = None
    # A stream's generation started early (see _start_constrained), its first output already taken.
    started: Optional[AsyncIterator[RequestOutput]] = None


@dataclass
class ChoiceState:
    """One choice of a response as it is built: its tokens so far and its stream's progress."""

    completion_tokens: int = 0
    text_offset: int = 0
    finished: bool = False
    echoed: bool = False
    tool_parser: Optional[ToolParser] = None
    reasoning_parser: Optional[ReasoningParser] = None
    harmony_parser: Optional[HarmonyParser] = None  # a harmony model's output (serving_harmony)


@dataclass
class Usage:
    """A response's token counts: its prompts' and, per choice, the completion's."""

    prompt_tokens: int = 0
    choices: dict[int, ChoiceState] = field(default_factory=dict)

    def to_dict(self) -> dict[str, int]:
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


def new_tokenizer_pool() -> ThreadPoolExecutor:
    """Tokenizing a multi-MB prompt takes ~1 s; done on one worker thread (the Rust tokenizer releases
    the GIL, and one thread keeps its use serialized) the event loop keeps streaming other requests
    meanwhile. The handlers of one server share it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlite-tokenize")


class OpenAIServing:
    """The base of the completions and chat handlers (vLLM's OpenAIServing)."""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, log_prompts: bool = False,
                 tokenizer_pool: Optional[ThreadPoolExecutor] = None) -> None:
        self.engine = engine
        self.log_prompts = log_prompts
        self.models = models  # the base model's names and the LoRA adapters: what `model` may name
        self.tokenizer = engine.tokenizer
        self.tokenizer_pool = tokenizer_pool or new_tokenizer_pool()

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizer thread (prompt rendering and tokenization)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def check_model(self, model: Optional[str]) -> str:
        """The name a response echoes for `model`: a served name or an adapter's; else vLLM's 404."""
        return self.models.resolve(model)[0]

    def resolve_model(self, model: Optional[str]) -> tuple[str, Optional[LoRARequest]]:
        """check_model's name and the LoRA adapter the request runs under (None: the base model)."""
        return self.models.resolve(model)

    def check_runner(self, runner: str) -> None:
        """A 400 naming the model's runner where a route needs the other one (generation vs pooling)."""
        if self.engine.runner == runner:
            return
        if runner == "pooling":
            raise OpenAIError("embeddings and scores need a pooling model; this model runs with runner='generate' "
                              "(/v1/completions, /v1/chat/completions)", 400, "model")
        raise OpenAIError("this model runs with runner='pooling' (embeddings and scores: /v1/embeddings, /pooling, "
                          "/score, /rerank): it does not generate text", 400, "model")

    def _prepare(self, prompt_text: Optional[str], token_ids: list[int], request: Any, request_id: str,
                 max_tokens: Optional[int], field_name: str, echo: bool = False,
                 lora_request: Optional[LoRARequest] = None) -> Prepared:
        if request.truncate_prompt_tokens is not None:
            token_ids = token_ids[-request.truncate_prompt_tokens:]
        if self.log_prompts:
            logger.info("request %s: prompt %r (%d tokens)", request_id, prompt_text, len(token_ids))
        max_len = self.engine.max_model_len
        n_prompt = len(token_ids)
        if n_prompt > max_len:
            raise OpenAIError(f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                              f"{n_prompt} tokens. Please reduce the length of the prompt.", 400, field_name)
        # max_tokens 0 (a completion's echo only, as vLLM): the prompt and its logprobs, nothing generated.
        if max_tokens is None:
            max_tokens = max(max_len - n_prompt, 1)
        elif max_tokens < (0 if echo else 1):
            hint = " (0, for the prompt's logprobs without generating, needs echo=true)" if max_tokens == 0 else ""
            raise OpenAIError(f"max_tokens must be at least 1, got {max_tokens}{hint}", 400, "max_tokens")
        elif max_tokens + n_prompt > max_len:
            raise OpenAIError(f"This model's maximum context length is {max_len} tokens. However, you requested "
                              f"{max_tokens + n_prompt} tokens ({n_prompt} in the {field_name}, {max_tokens} in the "
                              f"completion). Please reduce the length of the {field_name} or completion.", 400,
                              "max_tokens")
        try:
            params = request.to_sampling_params(max_tokens)
            engine_input = self.engine.process_inputs(
                request_id, {"prompt": prompt_text, "prompt_token_ids": token_ids}, params, request.priority,
                lora_request=lora_request)
        except ValueError as e:
            raise OpenAIError(str(e), 400, _field_of(str(e))) from None
        return Prepared(prompt_text, token_ids, request_id, engine_input, constraint_field(request))

    async def _generate_all(self, prepared: list[Prepared]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt's request concurrently; yield (prompt index, output) as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, p: Prepared) -> None:
            try:
                async for out in p.started or self.engine.generate(p.engine_input):
                    await queue.put((i, out))
            except BaseException as e:  # forwarded to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prepared)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, EngineBadRequestError):  # e.g. a schema that does not compile
                    raise OpenAIError(str(item), 400, prepared[i].constraint_field) from None
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _final_outputs(self, prepared: list[Prepared]) -> dict[int, RequestOutput]:
        """Each prompt's finished output, by prompt index (a non-streaming response's input)."""
        finals: dict[int, RequestOutput] = {}
        async for i, out in self._generate_all(prepared):
            if out.finished:
                finals[i] = out
        return finals

    async def _start_constrained(self, prepared: list[Prepared]) -> None:
        """Streams under a structured-output constraint start before the response does: the engine core
        compiles the grammar first, and one that does not compile is then a 400 (not an error event in
        a 200 stream). The first output is kept for the stream."""
        for p in prepared:
            if p.constraint_field is None:
                continue
            gen = self.engine.generate(p.engine_input)
            try:
                first = await gen.__anext__()
            except EngineBadRequestError as e:
                await _close_started(prepared)
                raise OpenAIError(str(e), 400, p.constraint_field) from None
            except BaseException:
                await _close_started(prepared)
                raise
            p.started = _chain(first, gen)

    @staticmethod
    def _response(base_id: str, object_name: str, model: str, choices: list[dict[str, Any]],
                  usage: Usage) -> dict[str, Any]:
        """A non-streaming response's body."""
        return {"id": base_id, "object": object_name, "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.to_dict()}

    @staticmethod
    async def _stream(choices: AsyncIterator[list[dict[str, Any]]], base_id: str, object_name: str, model: str,
                      usage: Usage, opts: Optional[StreamOptions]) -> AsyncIterator[str]:
        """A stream's SSE events: one chunk per list of choices that `choices` yields (with the usage so
        far when stream_options asks for it continuously), the final usage chunk, an error event if
        generation fails, then [DONE]."""
        created = int(time.time())
        include_usage = opts is not None and opts.include_usage
        continuous = opts is not None and opts.include_usage and opts.continuous_usage_stats

        def chunk(chunk_choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {"id": base_id, "object": object_name, "created": created, "model": model,
                    "choices": chunk_choices}

        try:
            async for chunk_choices in choices:
                body = chunk(chunk_choices)
                if include_usage:
                    body["usage"] = usage.to_dict() if continuous else None
                yield sse(body)
            if include_usage:
                yield sse({**chunk([]), "usage": usage.to_dict()})
        except Exception as e:
            yield sse(_stream_error(e))
        yield "data: [DONE]\n\n"

    def _tok(self, token_id: int, lp: Logprob) -> str:
        return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([token_id])


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    try:
        yield first
        async for out in rest:
            yield out
    finally:
        await rest.aclose()  # type: ignore[attr-defined]  # aborts the request if it is still running


async def _close_started(prepared: list[Prepared]) -> None:
    for p in prepared:
        if p.started is not None:
            await p.started.aclose()  # type: ignore[attr-defined]
            p.started = None


def finite_logprob(x: float) -> float:
    """JSON has no -inf; OpenAI clients expect a number."""
    return x if x > -9999.0 else -9999.0


def _field_of(message: str) -> Optional[str]:
    """Engine validation messages start with the field name."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None


def _stream_error(e: BaseException) -> dict[str, Any]:
    if isinstance(e, OpenAIError):
        return e.body()
    status = 503 if type(e).__name__ == "EngineDeadError" else 500
    return OpenAIError(str(e) or type(e).__name__, status).body()

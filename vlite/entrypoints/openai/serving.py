"""The /v1/completions and /v1/chat/completions handlers: requests in, OpenAI responses or SSE out."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from vlite.engine.async_llm import AsyncLLM, EngineBadRequestError
from vlite.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vlite.entrypoints.openai.structured_outputs import constraint_field
from vlite.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from vlite.entrypoints.openai.tool_parsers.constrained import NamedToolCallParser, RequiredToolCallParser
from vlite.outputs import CompletionOutput, Logprob, RequestOutput

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
class _Prepared:
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
class _Tools:
    """How a chat request's output is read for tool calls: tool_choice "auto" (the server's parser),
    "required" (a JSON array of calls) or "named" (the named function's arguments)."""

    choice: str
    make_parser: Callable[[], ToolParser]
    parallel: bool

    def finish_reason(self, called: bool, finish_reason: Optional[str]) -> Optional[str]:
        # OpenAI's (and vLLM's) rule: "tool_calls" when the model chose to call; a named function is "stop".
        return "tool_calls" if called and finish_reason == "stop" and self.choice != "named" else finish_reason


@dataclass
class _ChoiceState:
    completion_tokens: int = 0
    text_offset: int = 0
    finished: bool = False
    echoed: bool = False
    tool_parser: Optional[ToolParser] = None


@dataclass
class _Usage:
    prompt_tokens: int = 0
    choices: dict[int, _ChoiceState] = field(default_factory=dict)

    def to_dict(self) -> dict[str, int]:
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], log_prompts: bool = False,
                 trust_request_chat_template: bool = False, tool_call_parser: Optional[str] = None,
                 enable_auto_tool_choice: bool = False) -> None:
        # Tool calls of tool_choice "auto" are read by the parser named with --tool-call-parser, and only
        # with --enable-auto-tool-choice (vLLM's rule: the operator says the model can choose to call).
        self.tool_parser_cls = ToolParserManager.get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # A template in the request runs client-written Jinja: sandboxed, but a loop or a string
        # product can still burn CPU or memory, so it is opt-in (vLLM's rule).
        self.trust_request_chat_template = trust_request_chat_template
        self.engine = engine
        self.log_prompts = log_prompts
        self.served_model_names = served_model_names
        self.tokenizer = engine.tokenizer
        # Tokenizing a multi-MB prompt takes ~1 s; done here on one worker thread (the Rust
        # tokenizer releases the GIL, and one thread keeps its use serialized) the event loop
        # keeps streaming other requests meanwhile.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlite-tokenize")

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizer thread (prompt rendering and tokenization)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    # ---- shared -------------------------------------------------------------------------------

    def check_model(self, model: Optional[str]) -> str:
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def _prepare(self, prompt_text: Optional[str], token_ids: list[int], request: Any, request_id: str,
                 max_tokens: Optional[int], field_name: str) -> _Prepared:
        if request.truncate_prompt_tokens is not None:
            token_ids = token_ids[-request.truncate_prompt_tokens:]
        if self.log_prompts:
            logger.info("request %s: prompt %r (%d tokens)", request_id, prompt_text, len(token_ids))
        max_len = self.engine.max_model_len
        n_prompt = len(token_ids)
        if n_prompt > max_len:
            raise OpenAIError(f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                              f"{n_prompt} tokens. Please reduce the length of the prompt.", 400, field_name)
        # max_tokens 0 (echo only, as vLLM): the prompt and its logprobs, nothing generated.
        echo = isinstance(request, CompletionRequest) and request.echo
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
                request_id, {"prompt": prompt_text, "prompt_token_ids": token_ids}, params, request.priority)
        except ValueError as e:
            raise OpenAIError(str(e), 400, _field_of(str(e))) from None
        return _Prepared(prompt_text, token_ids, request_id, engine_input, constraint_field(request))

    async def _generate_all(self, prepared: list[_Prepared]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt's request concurrently; yield (prompt index, output) as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, p: _Prepared) -> None:
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

    async def _start_constrained(self, prepared: list[_Prepared]) -> None:
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

    # ---- completions --------------------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest) -> Any:
        model = self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported", 400, "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (it must equal n)", 400, "best_of")
        prompts = await self.run_tokenizer(self._completion_prompts, request.prompt)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        prepared = [self._prepare(text, ids, request, f"{base_id}-{i}", request.max_tokens, "prompt")
                    for i, (text, ids) in enumerate(prompts)]
        echo = await self.run_tokenizer(self._echo_texts, prompts, prepared) if request.echo else None
        if request.stream:
            await self._start_constrained(prepared)
            return self._completion_stream(request, prepared, base_id, model, echo)
        return self._completion_full(request, prepared, base_id, model, echo)  # awaited by the route

    def _echo_texts(self, prompts: list[tuple[Optional[str], list[int]]], prepared: list[_Prepared]) -> list[str]:
        """What each choice's text starts with under echo: the prompt as sent, or its tokens decoded
        (a prompt of token ids, or one cut by truncate_prompt_tokens)."""
        return [text if text is not None and len(ids) == len(p.token_ids) else self.tokenizer.decode(p.token_ids)
                for (text, ids), p in zip(prompts, prepared)]

    def _completion_prompts(self, prompt: Any) -> list[tuple[Optional[str], list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt must not be empty", 400, "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise OpenAIError("prompt must not be empty", 400, "prompt")
                out.append((p, self.tokenizer.encode(p)))
            else:
                if not p:
                    raise OpenAIError("prompt must not be empty", 400, "prompt")
                out.append((None, list(p)))
        return out

    async def _completion_full(self, request: CompletionRequest, prepared: list[_Prepared], base_id: str,
                               model: str, echo: Optional[list[str]]) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in self._generate_all(prepared):
            if out.finished:
                finals[i] = out
        choices, usage = [], _Usage()
        for i, p in enumerate(prepared):
            out = finals[i]
            usage.prompt_tokens += len(p.token_ids)
            for c in sorted(out.outputs, key=lambda c: c.index):
                index = i * request.n + c.index
                usage.choices[index] = _ChoiceState(completion_tokens=len(c.token_ids))
                prefix = echo[i] if echo is not None else None
                choices.append({"index": index, "text": (prefix or "") + c.text,
                                "logprobs": self._choice_logprobs(request, p, out, c, prefix, 0),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": base_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.to_dict()}

    async def _completion_stream(self, request: CompletionRequest, prepared: list[_Prepared], base_id: str,
                                 model: str, echo: Optional[list[str]]) -> AsyncIterator[str]:
        created = int(time.time())
        opts = request.stream_options
        usage = _Usage(prompt_tokens=sum(len(p.token_ids) for p in prepared))
        try:
            async for i, out in self._generate_all(prepared):
                for c in out.outputs:
                    index = i * request.n + c.index
                    state = usage.choices.setdefault(index, _ChoiceState())
                    state.completion_tokens += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue  # e.g. a chunk of the prompt computed (its logprobs wait for the echo)
                    # Under echo, a choice's first chunk starts with the prompt (and its logprobs).
                    prefix = echo[i] if echo is not None and not state.echoed else None
                    state.echoed = True
                    logprobs = self._choice_logprobs(request, prepared[i], out, c, prefix, state.text_offset)
                    text = (prefix or "") + c.text
                    state.text_offset += len(text)
                    chunk = {"id": base_id, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if opts is not None and opts.include_usage:
                        chunk["usage"] = usage.to_dict() if opts.continuous_usage_stats else None
                    yield sse(chunk)
            if opts is not None and opts.include_usage:
                yield sse({"id": base_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage.to_dict()})
        except Exception as e:
            yield sse(_stream_error(e))
        yield "data: [DONE]\n\n"

    def _choice_logprobs(self, request: CompletionRequest, p: _Prepared, out: RequestOutput, c: CompletionOutput,
                         prefix: Optional[str], text_offset: int) -> Optional[dict[str, Any]]:
        """A choice's (or a stream chunk's) logprobs object; with `prefix` (the echoed prompt, which
        starts at text_offset) the prompt's tokens come first and the generated ones after it."""
        if request.logprobs is None:
            return None
        n = request.logprobs
        if prefix is None:
            return self._completion_logprobs(c.token_ids, c.logprobs or [], n, text_offset)
        prompt_logprobs = out.prompt_logprobs or []
        if len(prompt_logprobs) != len(p.token_ids):
            raise OpenAIError(f"the engine returned logprobs for {len(prompt_logprobs)} of the prompt's "
                              f"{len(p.token_ids)} tokens", 500)
        head = self._completion_logprobs(p.token_ids, prompt_logprobs, n, text_offset)
        tail = self._completion_logprobs(c.token_ids, c.logprobs or [], n, text_offset + len(prefix))
        return {key: head[key] + tail[key] for key in head}

    def _completion_logprobs(self, token_ids: list[int], positions: list[Optional[dict[int, Logprob]]], n: int,
                             text_offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object: per token its text, logprob, the top n at its position (with
        the token itself) and where its text starts. A prompt's first token has no logprobs: nulls."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = text_offset
        for token_id, position in zip(token_ids, positions):
            if position is None:
                text = self.tokenizer.decode([token_id])
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                chosen = position.get(token_id) or Logprob(float("-inf"))
                text = self._tok(token_id, chosen)
                token_logprobs.append(_finite(chosen.logprob))
                top_logprobs.append({self._tok(t, lp): _finite(lp.logprob)
                                     for t, lp in islice(position.items(), n + 1)})
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _tok(self, token_id: int, lp: Logprob) -> str:
        return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([token_id])

    # ---- chat ---------------------------------------------------------------------------------

    def render_chat(self, request: Any) -> tuple[str, list[int]]:
        messages = []
        for m in request.messages:
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise OpenAIError("only text content parts are supported", 400, "messages")
                    parts.append(part["text"])
                content = "".join(parts)
            message: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.tool_calls:
                message["tool_calls"] = [_template_tool_call(i, tc) for i, tc in enumerate(m.tool_calls)]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                message["name"] = m.name
            messages.append(message)
        if not messages:
            raise OpenAIError("messages must not be empty", 400, "messages")
        kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
        tools = getattr(request, "tools", None)
        if tools:
            # As vLLM and transformers pass them: the template renders the functions (those that know how).
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=getattr(request, "chat_template", None), tokenize=False,
                add_generation_prompt=request.add_generation_prompt and not getattr(
                    request, "continue_final_message", False),
                continue_final_message=getattr(request, "continue_final_message", False), **kwargs)
        except Exception as e:  # a template that raises is the request's problem, not a server error
            param = "chat_template" if getattr(request, "chat_template", None) is not None else \
                "chat_template_kwargs" if kwargs and isinstance(e, TypeError) else "messages"
            raise OpenAIError(f"chat template failed: {e}", 400, param) from None
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Any:
        model = self.check_model(request.model)
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is disabled on this server; start it with "
                              "--trust-request-chat-template to allow it", 400, "chat_template")
        tools = self._check_tools(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        text, ids = await self.run_tokenizer(self.render_chat, request)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        try:
            prepared = [self._prepare(text, ids, request, base_id, max_tokens, "messages")]
        except OpenAIError as e:
            if tools is not None and tools.choice != "auto" and e.message.startswith("structured_outputs"):
                # The schema built from the tools' parameters (tool_choice required / named) is invalid.
                raise OpenAIError(f"tools: a function's parameters are not a usable JSON schema: {e.message}",
                                  400, "tools") from None
            raise
        if tools is not None and tools.choice != "auto":
            prepared[0].constraint_field = "tools"  # the schema (compiled in the engine) comes from the tools
        if request.stream:
            await self._start_constrained(prepared)
            return self._chat_stream(request, prepared, base_id, model, tools)
        return self._chat_full(request, prepared, base_id, model, tools)  # awaited by the route

    def _check_tools(self, request: ChatCompletionRequest) -> Optional[_Tools]:
        """vLLM's rules for tools / tool_choice; None when the output is not read for tool calls."""
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if request.tools else "none"
        if choice == "none":
            return None
        if not request.tools:
            raise OpenAIError("When using `tool_choice`, `tools` must be set.", 400, "tool_choice")
        parallel = request.parallel_tool_calls is not False
        if choice == "auto":
            if not self.enable_auto_tool_choice or self.tool_parser_cls is None:
                raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                  "to be set", 400, "tool_choice")
            parser_cls = self.tool_parser_cls
            return _Tools("auto", lambda: parser_cls(self.tokenizer), parallel)
        if choice == "required":
            return _Tools("required", lambda: RequiredToolCallParser(self.tokenizer), parallel)
        name = choice.function.name
        if name not in [t.function.name for t in request.tools]:
            raise OpenAIError(f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified "
                              f"`tools`: {[t.function.name for t in request.tools]}", 400, "tool_choice")
        return _Tools("named", lambda: NamedToolCallParser(name, self.tokenizer), parallel)

    async def _chat_full(self, request: ChatCompletionRequest, prepared: list[_Prepared], base_id: str,
                         model: str, tools: Optional[_Tools] = None) -> dict[str, Any]:
        final = None
        async for _, out in self._generate_all(prepared):
            if out.finished:
                final = out
        assert final is not None
        usage = _Usage(prompt_tokens=len(prepared[0].token_ids))
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            usage.choices[c.index] = _ChoiceState(completion_tokens=len(c.token_ids))
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if tools is not None:
                parsed = tools.make_parser().extract_tool_calls(c.text)
                message["content"] = parsed.content if parsed.tools_called else parsed.content or ""
                if parsed.tools_called:
                    message["tool_calls"] = parsed.tool_calls if tools.parallel else parsed.tool_calls[:1]
                finish_reason = tools.finish_reason(parsed.tools_called, finish_reason)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c, request) if request.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": base_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.to_dict()}

    async def _chat_stream(self, request: ChatCompletionRequest, prepared: list[_Prepared], base_id: str,
                           model: str, tools: Optional[_Tools] = None) -> AsyncIterator[str]:
        created = int(time.time())
        opts = request.stream_options
        usage = _Usage(prompt_tokens=len(prepared[0].token_ids))

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            body = {"id": base_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices}
            if opts is not None and opts.include_usage:
                body["usage"] = usage.to_dict() if opts.continuous_usage_stats else None
            return body

        try:
            # The first chunk of each choice carries the role.
            yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(request.n)]))
            async for _, out in self._generate_all(prepared):
                for c in out.outputs:
                    state = usage.choices.setdefault(c.index, _ChoiceState())
                    state.completion_tokens += len(c.token_ids)
                    delta: dict[str, Any] = {"content": c.text} if c.text else {}
                    finish_reason = c.finish_reason
                    if tools is not None:
                        delta, finish_reason = self._tool_delta(tools, state, c)
                    if not delta and c.finish_reason is None and not (request.logprobs and c.token_ids):
                        continue
                    yield sse(chunk([{"index": c.index, "delta": delta,
                                      "logprobs": self._chat_logprobs(c, request) if request.logprobs else None,
                                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}]))
            if opts is not None and opts.include_usage:
                yield sse({"id": base_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": usage.to_dict()})
        except Exception as e:
            yield sse(_stream_error(e))
        yield "data: [DONE]\n\n"

    @staticmethod
    def _tool_delta(tools: _Tools, state: _ChoiceState, c: CompletionOutput) -> tuple[dict[str, Any], Optional[str]]:
        """A streamed piece of a choice read for tool calls: its content and tool-call deltas."""
        if state.tool_parser is None:
            state.tool_parser = tools.make_parser()
        parser = state.tool_parser
        d = parser.extract_tool_calls_streaming(c.text)
        if c.finish_reason is not None:
            d.extend(parser.finish_streaming())
        delta: dict[str, Any] = {}
        if d.content:
            delta["content"] = d.content
        calls = d.tool_calls if tools.parallel else [tc for tc in d.tool_calls if tc["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta, tools.finish_reason(parser.num_calls > 0, c.finish_reason)

    def _chat_logprobs(self, c: CompletionOutput, request: ChatCompletionRequest) -> dict[str, Any]:
        n_top = request.top_logprobs or 0
        content = []
        for token_id, position in zip(c.token_ids, c.logprobs or []):
            chosen = position.get(token_id) or Logprob(float("-inf"))
            text = self._tok(token_id, chosen)
            top = sorted(((t, lp) for t, lp in position.items() if (lp.rank or 0) <= n_top),
                         key=lambda kv: kv[1].rank or 0)[:n_top]
            content.append({"token": text, "logprob": _finite(chosen.logprob), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self._tok(t, lp), "logprob": _finite(lp.logprob),
                                              "bytes": list(self._tok(t, lp).encode())} for t, lp in top]})
        return {"content": content}


def _template_tool_call(i: int, tc: Any) -> dict[str, Any]:
    """A history tool call as HF chat templates expect it: the arguments a dict, not a JSON string."""
    try:
        arguments = json.loads(tc.function.arguments)
    except ValueError:
        raise OpenAIError(f"messages: tool_calls[{i}].function.arguments is not valid JSON", 400, "messages") from None
    return {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": arguments}}


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    try:
        yield first
        async for out in rest:
            yield out
    finally:
        await rest.aclose()  # type: ignore[attr-defined]  # aborts the request if it is still running


async def _close_started(prepared: list[_Prepared]) -> None:
    for p in prepared:
        if p.started is not None:
            await p.started.aclose()  # type: ignore[attr-defined]
            p.started = None


def _finite(x: float) -> float:
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

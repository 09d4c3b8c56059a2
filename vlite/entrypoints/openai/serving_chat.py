"""/v1/chat/completions: messages rendered with the chat template, a chat.completion response or its SSE
stream out, read for tool calls where the request asks for them."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from vlite.config import ReasoningConfig
from vlite.engine.async_llm import AsyncLLM
from vlite.entrypoints.openai.protocol import ChatCompletionRequest
from vlite.entrypoints.openai.serving_models import OpenAIServingModels
from vlite.entrypoints.openai.serving_engine import (ChoiceState, OpenAIError, OpenAIServing, Prepared, Usage,
                                                     finite_logprob)
from vlite.entrypoints.openai.serving_harmony import HarmonyChat, full_message, new_parser, stream_delta
from vlite.entrypoints.openai.tool_parsers import OpenAIToolParser, ToolParser, ToolParserManager
from vlite.entrypoints.openai.tool_parsers.constrained import NamedToolCallParser, RequiredToolCallParser
from vlite.outputs import CompletionOutput, Logprob
from vlite.reasoning import ReasoningParser

# apply_chat_template's own parameters: chat_template_kwargs may not set them.
_TEMPLATE_PARAMS = {"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
                    "continue_final_message", "tools", "documents", "return_dict", "return_tensors", "padding",
                    "truncation", "max_length"}


def check_template_kwargs(kwargs: Any, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """chat_template_kwargs (a request's, or the server's defaults): a dict of template variables, none of
    them one of apply_chat_template's own parameters; enable_thinking a boolean."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"{field} must be a JSON object, got {type(kwargs).__name__}")
    clash = sorted(set(kwargs) & _TEMPLATE_PARAMS)
    if clash:
        raise ValueError(f"{field} may not set {clash}: they are the request's own fields")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise ValueError(f"{field}.enable_thinking must be true or false, got {kwargs['enable_thinking']!r}")
    return kwargs


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
class _Split:
    """How a chat request's outputs are split into reasoning and answer: the server's parser, where the
    output starts (read off the rendered prompt's end), and whether the reasoning is returned at all."""

    parser_cls: type[ReasoningParser]
    phase: str
    include: bool

    def new_parser(self, tokenizer: Any) -> ReasoningParser:
        return self.parser_cls(tokenizer, self.phase)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, log_prompts: bool = False,
                 trust_request_chat_template: bool = False, tool_call_parser: Optional[str] = None,
                 enable_auto_tool_choice: bool = False, tokenizer_pool: Optional[ThreadPoolExecutor] = None,
                 default_chat_template_kwargs: Optional[dict[str, Any]] = None) -> None:
        super().__init__(engine, models, log_prompts, tokenizer_pool)
        self.default_chat_template_kwargs = check_template_kwargs(dict(default_chat_template_kwargs or {}),
                                                                  "default_chat_template_kwargs")
        # The engine's --reasoning-parser: outputs split into `reasoning` and the answer (None: no split).
        args = getattr(engine, "engine_args", None)
        config = ReasoningConfig.from_user(getattr(args, "reasoning_parser", None),
                                           getattr(args, "reasoning_config", None))
        self.reasoning_parser_cls: Optional[type[ReasoningParser]] = config.parser_class() if config else None
        # Tool calls of tool_choice "auto" are read by the parser named with --tool-call-parser, and only
        # with --enable-auto-tool-choice (vLLM's rule: the operator says the model can choose to call).
        self.tool_parser_cls = ToolParserManager.get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # A template in the request runs client-written Jinja: sandboxed, but a loop or a string
        # product can still burn CPU or memory, so it is opt-in (vLLM's rule).
        self.trust_request_chat_template = trust_request_chat_template
        # A harmony model (gpt-oss): prompts rendered and outputs read in harmony (serving_harmony).
        self.harmony = HarmonyChat.for_tokenizer(self.tokenizer, getattr(args, "chat_template", None))

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
        try:
            kwargs = {**self.default_chat_template_kwargs,
                      **check_template_kwargs(getattr(request, "chat_template_kwargs", None) or {})}
        except ValueError as e:
            raise OpenAIError(str(e), 400, "chat_template_kwargs") from None
        tools = getattr(request, "tools", None)
        if tools:
            # As vLLM and transformers pass them: the template renders the functions (those that know how).
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        if self.harmony is not None and self.harmony.renders(request):
            try:
                text = self.harmony.render(request, messages, kwargs)
            except ValueError as e:
                raise OpenAIError(str(e), 400, "tools" if str(e).startswith("tools") else "messages") from None
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if getattr(request, "reasoning_effort", None) is not None:
            kwargs.setdefault("reasoning_effort", request.reasoning_effort)  # gpt-oss's template variable
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
        model, lora_request = self.resolve_model(request.model)
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is disabled on this server; start it with "
                              "--trust-request-chat-template to allow it", 400, "chat_template")
        tools = self._check_tools(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        if self.harmony is not None:
            self.harmony.prepare(request)
        text, ids = await self.run_tokenizer(self.render_chat, request)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        try:
            prepared = [self._prepare(text, ids, request, base_id, max_tokens, "messages", lora_request=lora_request)]
        except OpenAIError as e:
            if tools is not None and tools.choice != "auto" and e.message.startswith("structured_outputs"):
                # The schema built from the tools' parameters (tool_choice required / named) is invalid.
                raise OpenAIError(f"tools: a function's parameters are not a usable JSON schema: {e.message}",
                                  400, "tools") from None
            raise
        if tools is not None and tools.choice != "auto":
            prepared[0].constraint_field = "tools"  # the schema (compiled in the engine) comes from the tools
        split = None if self.reasoning_parser_cls is None or self.harmony is not None else \
            _Split(self.reasoning_parser_cls, self.reasoning_parser_cls.prompt_phase(text), request.include_reasoning)
        if request.stream:
            await self._start_constrained(prepared)
            usage = Usage(prompt_tokens=len(prepared[0].token_ids))
            return self._stream(self._chat_chunks(request, prepared, usage, tools, split), base_id,
                                "chat.completion.chunk", model, usage, request.stream_options)
        return self._chat_full(request, prepared, base_id, model, tools, split)  # awaited by the route

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
        if self.harmony is not None and choice != "auto":
            raise OpenAIError('harmony (gpt-oss) chats support tool_choice "auto" and "none" only', 400, "tool_choice")
        if self.harmony is not None and self.enable_auto_tool_choice and self.tool_parser_cls is not None and \
                not issubclass(self.tool_parser_cls, OpenAIToolParser):
            raise OpenAIError("this model writes tool calls in the harmony format: start the server with "
                              "--tool-call-parser openai", 400, "tool_choice")
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

    async def _chat_full(self, request: ChatCompletionRequest, prepared: list[Prepared], base_id: str,
                         model: str, tools: Optional[_Tools] = None, split: Optional[_Split] = None) -> dict[str, Any]:
        final = (await self._final_outputs(prepared)).get(0)
        assert final is not None
        usage = Usage(prompt_tokens=len(prepared[0].token_ids))
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            usage.choices[c.index] = ChoiceState(completion_tokens=len(c.token_ids))
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if self.harmony is not None:
                message, called = full_message(prepared[0].text or "", c.text, tools, request.include_reasoning)
                choices.append({"index": c.index, "message": message,
                                "logprobs": self._chat_logprobs(c, request) if request.logprobs else None,
                                "finish_reason": tools.finish_reason(called, finish_reason) if tools else finish_reason,
                                "stop_reason": c.stop_reason})
                continue
            if split is not None:  # the thinking apart; tool calls are read from the answer only
                reasoning, message["content"] = split.new_parser(self.tokenizer).extract_reasoning(c.text)
                if split.include:
                    message["reasoning"] = message["reasoning_content"] = reasoning  # vLLM's names, new and old
            if tools is not None:
                parsed = tools.make_parser().extract_tool_calls(message["content"] or "")
                message["content"] = parsed.content if parsed.tools_called else parsed.content or ""
                if parsed.tools_called:
                    message["tool_calls"] = parsed.tool_calls if tools.parallel else parsed.tool_calls[:1]
                finish_reason = tools.finish_reason(parsed.tools_called, finish_reason)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c, request) if request.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return self._response(base_id, "chat.completion", model, choices, usage)

    async def _chat_chunks(self, request: ChatCompletionRequest, prepared: list[Prepared], usage: Usage,
                           tools: Optional[_Tools] = None, split: Optional[_Split] = None
                           ) -> AsyncIterator[list[dict[str, Any]]]:
        """The choices of each stream chunk (see OpenAIServing._stream), counting tokens into `usage`. With a
        reasoning parser, `reasoning` deltas (the thinking) come before the answer's."""
        # The first chunk of each choice carries the role.
        yield [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(request.n)]
        async for _, out in self._generate_all(prepared):
            for c in out.outputs:
                state = usage.choices.setdefault(c.index, ChoiceState())
                state.completion_tokens += len(c.token_ids)
                text, reasoning = c.text, ""
                if self.harmony is not None:
                    if state.harmony_parser is None:
                        state.harmony_parser = new_parser(prepared[0].text or "")
                    delta, called = stream_delta(state.harmony_parser, c.text, c.finish_reason is not None, tools,
                                                 request.include_reasoning)
                    finish_reason = tools.finish_reason(called, c.finish_reason) if tools else c.finish_reason
                    if delta or c.finish_reason is not None or (request.logprobs and c.token_ids):
                        yield [{"index": c.index, "delta": delta,
                                "logprobs": self._chat_logprobs(c, request) if request.logprobs else None,
                                "finish_reason": finish_reason, "stop_reason": c.stop_reason}]
                    continue
                if split is not None:
                    if state.reasoning_parser is None:
                        state.reasoning_parser = split.new_parser(self.tokenizer)
                    d = state.reasoning_parser.extract_reasoning_streaming(c.text)
                    if c.finish_reason is not None:
                        d.extend(state.reasoning_parser.finish_streaming())
                    text, reasoning = d.content, d.reasoning if split.include else ""
                delta: dict[str, Any] = {"content": text} if text else {}
                finish_reason = c.finish_reason
                if tools is not None:
                    delta, finish_reason = self._tool_delta(tools, state, text, c.finish_reason)
                if reasoning:
                    delta = {"reasoning": reasoning, "reasoning_content": reasoning, **delta}
                if not delta and c.finish_reason is None and not (request.logprobs and c.token_ids):
                    continue
                yield [{"index": c.index, "delta": delta,
                        "logprobs": self._chat_logprobs(c, request) if request.logprobs else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason}]

    @staticmethod
    def _tool_delta(tools: _Tools, state: ChoiceState, text: str,
                    finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """A streamed piece of a choice's answer read for tool calls: its content and tool-call deltas."""
        if state.tool_parser is None:
            state.tool_parser = tools.make_parser()
        parser = state.tool_parser
        d = parser.extract_tool_calls_streaming(text)
        if finish_reason is not None:
            d.extend(parser.finish_streaming())
        delta: dict[str, Any] = {}
        if d.content:
            delta["content"] = d.content
        calls = d.tool_calls if tools.parallel else [tc for tc in d.tool_calls if tc["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta, tools.finish_reason(parser.num_calls > 0, finish_reason)

    def _chat_logprobs(self, c: CompletionOutput, request: ChatCompletionRequest) -> dict[str, Any]:
        n_top = request.top_logprobs or 0
        content = []
        for token_id, position in zip(c.token_ids, c.logprobs or []):
            chosen = position.get(token_id) or Logprob(float("-inf"))
            text = self._tok(token_id, chosen)
            top = sorted(((t, lp) for t, lp in position.items() if (lp.rank or 0) <= n_top),
                         key=lambda kv: kv[1].rank or 0)[:n_top]
            content.append({"token": text, "logprob": finite_logprob(chosen.logprob), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self._tok(t, lp), "logprob": finite_logprob(lp.logprob),
                                              "bytes": list(self._tok(t, lp).encode())} for t, lp in top]})
        return {"content": content}


def _template_tool_call(i: int, tc: Any) -> dict[str, Any]:
    """A history tool call as HF chat templates expect it: the arguments a dict, not a JSON string."""
    try:
        arguments = json.loads(tc.function.arguments)
    except ValueError:
        raise OpenAIError(f"messages: tool_calls[{i}].function.arguments is not valid JSON", 400, "messages") from None
    return {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": arguments}}

"""OpenAI wire format (plus vLLM's extra sampling fields) as pydantic models.

Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vlite.entrypoints.openai.structured_outputs import structured_outputs_of
from vlite.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


# Caps on request size that keep one request from monopolising the server (documented in
# docs/reliability.md): beyond them a request gets a 400 naming the field and the limit.
MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20

# Integers travel to the engine core as msgpack int64 and end up in int64 tensors: a larger value
# would fail there (a 500, or a failed engine step), so it is a 400 here.
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]


def _no_lone_surrogates(value: Any, field_name: str) -> Any:
    """JSON escapes can smuggle in lone UTF-16 surrogates that no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{field_name} contains invalid Unicode (a lone surrogate)") from None
    elif isinstance(value, list):
        for v in value:
            _no_lone_surrogates(v, field_name)
    elif isinstance(value, dict):
        for v in value.values():
            _no_lone_surrogates(v, field_name)
    return value


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by both endpoints, vLLM's extras included."""

    model: Optional[str] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[Int64] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = Field(default=None, max_length=1024)
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[str, float]] = Field(default=None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = Field(default=None, max_length=MAX_STOP_STRINGS)
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=1, le=2**63 - 1)
    # With --reasoning-parser: the most thinking tokens before the end tag is forced (vLLM's extra parameter;
    # None: the server's --reasoning-budget).
    thinking_token_budget: Optional[Int64] = None
    priority: Int64 = 0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Structured outputs (entrypoints/openai/structured_outputs.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* names; at most one per request.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return _no_lone_surrogates(v, "stop")

    def _sampling_params(self, max_tokens: int, logprobs: Optional[int],
                         prompt_logprobs: Optional[int] = None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            thinking_token_budget=self.thinking_token_budget,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs_of(self)[0],
        )


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[Int64] = 16
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[Int64] = None
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        return _no_lone_surrogates(v, "prompt")

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            # Echoed logprobs cover the prompt too (vLLM's rule); max_tokens 0 computes the prompt
            # and samples nothing, which the engine allows only for a request scoring its prompt.
            prompt_logprobs = self.logprobs if self.logprobs is not None else 0 if max_tokens == 0 else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One entry of `tools`: a function the model may call, its parameters a JSON schema."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """`tool_choice` naming the function that must be called."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCallParam(OpenAIBaseModel):
    """A call in an assistant message of the history (arguments as the JSON string OpenAI sends)."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallParam]] = None
    tool_call_id: Optional[str] = None
    # An assistant message's thinking, as responses return it (vLLM's names): harmony chats (gpt-oss) render
    # it back where the turn is still calling tools.
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None

    @field_validator("content", "role", "reasoning", "reasoning_content")
    @classmethod
    def _check_text(cls, v: Any) -> Any:
        return _no_lone_surrogates(v, "messages")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the thinking out of the response
    # OpenAI's field: how hard a reasoning model thinks. Harmony chats (gpt-oss) write it into the system
    # message ("Reasoning: low|medium|high", medium when unset); other templates get it as a variable.
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = None
    echo: bool = False
    tools: Optional[list[ChatCompletionToolsParam]] = Field(default=None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoiceParam]] = None
    parallel_tool_calls: Optional[bool] = True
    response_format: Optional[dict[str, Any]] = None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = None
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        params = self._sampling_params(max_tokens, logprobs)
        tool_constraint = self.tool_structured_outputs()
        if tool_constraint is not None:
            params.structured_outputs = tool_constraint
        return params

    def tool_structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """tool_choice "required" or a named function: the output is generated under a JSON schema so that
        the call always parses (vLLM's rule, ahead of any response_format): a non-empty array of
        {"name", "parameters"} calls, or the named function's arguments."""
        from vlite.entrypoints.openai.tool_parsers.constrained import parameters_schema, required_schema

        if not self.tools or self.tool_choice is None or isinstance(self.tool_choice, str) and \
                self.tool_choice != "required":
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.tool_choice == "required":
            return StructuredOutputsParams(json=required_schema(tools, self.parallel_tool_calls is not False))
        name = self.tool_choice.function.name
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        return None if tool is None else StructuredOutputsParams(json=parameters_schema(tool))


class TokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        return _no_lone_surrogates(v, "prompt")


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]



# ---- runtime LoRA adapters (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -----------------------

class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: Optional[str] = None  # vLLM requires it; the adapter's lora_int_id alone also names it here
    lora_int_id: Optional[int] = None

# ---- pooling routes: OpenAI's /v1/embeddings, vLLM's /pooling, /score and /rerank --------------------------

MAX_POOLING_INPUTS = 2048  # OpenAI's limit on an embeddings request's inputs; /score and /rerank's texts too


def _check_texts(v: Any, field_name: str) -> Any:
    if isinstance(v, list) and len(v) > MAX_POOLING_INPUTS:
        raise ValueError(f"at most {MAX_POOLING_INPUTS} inputs are allowed, got {len(v)}")
    return _no_lone_surrogates(v, field_name)


class _PoolingFields(OpenAIBaseModel):
    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None  # -1: as many as the model takes
    priority: Int64 = 0


class EmbeddingRequest(_PoolingFields):
    """OpenAI's request (`user` ignored) with vLLM's extras: truncate_prompt_tokens, normalize."""

    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    normalize: Optional[bool] = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, v: Any) -> Any:
        return _check_texts(v, "input")


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the model's own pooled output of each input (an embedding, a classifier's scores)."""

    activation: Optional[bool] = None


class ScoreRequest(_PoolingFields):
    """vLLM's /score: text_1 against each text_2 (1:N), or pairwise (N:N)."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    activation: Optional[bool] = None

    @field_validator("text_1", "text_2")
    @classmethod
    def _check_text(cls, v: Any, info: Any) -> Any:
        return _check_texts(v, info.field_name)


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankRequest(_PoolingFields):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents by relevance to the query."""

    query: str
    documents: list[Union[str, RerankDocument]]
    top_n: int = Field(default=0, ge=0)  # 0: all of them
    return_documents: bool = True
    activation: Optional[bool] = None

    @field_validator("query", "documents")
    @classmethod
    def _check_text(cls, v: Any, info: Any) -> Any:
        _check_texts([d.text if isinstance(d, RerankDocument) else d for d in v] if isinstance(v, list) else v,
                     info.field_name)
        return v


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


Role = Literal["system", "user", "assistant", "tool", "developer"]

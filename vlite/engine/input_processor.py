"""InputProcessor: user prompt + SamplingParams -> EngineCoreRequest, validated up front.

Every check that can reject a request runs here, before the engine core sees it, so bad input
never reaches a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

from vlite.lora.request import LoRARequest
from vlite.pooling_params import PoolingParams
from vlite.sampling_params import SamplingParams

PromptType = Union[str, dict, list[int]]


@dataclass
class EngineCoreRequest:
    """What crosses into the engine core for one request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    pooling_params: Optional[PoolingParams] = None  # a pooling request (its sampling_params ask for no token)
    token_type_ids: Optional[list[int]] = None  # cross-encoders: 0 for the query's tokens, 1 for the document's
    lora_request: Optional[LoRARequest] = None  # the adapter it runs under; None: the base model


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, kv_capacity_tokens: int,
                 eos_token_ids: tuple[int, ...],
                 validate_structured_outputs: Optional[Callable[[Any], None]] = None) -> None:
        self.tokenizer = tokenizer
        # Where the engine core runs in this process: parse structured-output specs up front.
        self.validate_structured_outputs = validate_structured_outputs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv_capacity_tokens = kv_capacity_tokens
        self.eos_token_ids = eos_token_ids
        # Models that compute a prompt in one step (encoders): the longest prompt a step takes.
        self.max_prompt_tokens: Optional[int] = None
        # A pooling model's pipeline (vlite.pooling.config.PoolerConfig), None for a generation model; with the
        # size of its hidden states (what `dimensions` may not exceed).
        self.pooler_config: Any = None
        self.hidden_size = 0
        self._prompt_tokens: Optional[int] = None  # _prompt_length, once
        # The engine was started with enable_lora (requests may name an adapter).
        self.enable_lora = False
        # The engine has a reasoning parser (thinking_token_budget needs one), and its reasoning_budget: the
        # thinking_token_budget of requests that set none (llama.cpp's --reasoning-budget; -1: unlimited).
        self.reasoning_parser = False
        self.reasoning_budget = -1

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: Optional[float] = None, priority: int = 0,
                       lora_request: Optional[LoRARequest] = None) -> tuple[Optional[str], EngineCoreRequest]:
        self.check_lora(lora_request)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if self.pooler_config is not None:
            raise ValueError("this model runs with runner='pooling' (embeddings and scores): it does not generate "
                             "text")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        prompt_text, token_ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        self._validate(token_ids, params)
        params = params.clone()
        if params.thinking_token_budget is None and self.reasoning_budget >= 0:
            params.thinking_token_budget = self.reasoning_budget
        if params.bad_words:
            params._bad_words_token_ids = self._tokenize_bad_words(params.bad_words)
        return prompt_text, EngineCoreRequest(request_id, token_ids, params, self.eos_token_ids,
                                              arrival_time or time.time(), priority, lora_request=lora_request)

    def check_lora(self, lora_request: Optional[LoRARequest], pooling: bool = False) -> None:
        """A request's (or add_lora's) adapter, refused by name before anything starts: LoRA off, not a
        LoRARequest, or a pooling request (adapters apply to generation only)."""
        if lora_request is None:
            return
        if pooling:
            raise ValueError("lora_request: LoRA adapters apply to text generation only, not to pooling")
        if not self.enable_lora:
            raise ValueError(f"lora_request {getattr(lora_request, 'lora_name', lora_request)!r} given, but LoRA "
                             f"is not enabled: start the engine with enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")

    def pooling_text(self, prompt: PromptType) -> Optional[str]:
        """The text the tokenizer gets for a plain-text pooling prompt, after sentence-transformers' own steps
        (the default prompt, lowercasing); None for token ids, pairs and empty text."""
        config = self.pooler_config
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt
            and "prompt_pair" not in prompt else None)
        if not isinstance(text, str) or not text:
            return None
        if config is not None and (config.do_lower_case or config.default_prompt_name):
            text = config.prompts.get(config.default_prompt_name, "") + text
            text = text.lower() if config.do_lower_case else text
        return text

    def _prompt_length(self) -> int:
        """sentence-transformers' prompt_length: the default prompt's own token ids less one (the special token
        a tokenizer puts after them), the leading tokens a pipeline with include_prompt False does not pool."""
        if self._prompt_tokens is None:
            config = self.pooler_config
            ids = self.tokenizer(config.prompts.get(config.default_prompt_name, ""))["input_ids"]
            self._prompt_tokens = max(len(ids) - 1, 0)
        return self._prompt_tokens

    def _truncation(self, params: PoolingParams) -> Optional[int]:
        """The token count a pooling request's prompt is truncated to (None: not truncated; -1: max_model_len);
        a ValueError where it asks for more than max_model_len."""
        limit = params.truncate_prompt_tokens
        if limit is not None and limit > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({limit}) exceeds max_model_len ({self.max_model_len})")
        return self.max_model_len if limit == -1 else limit

    def tokenize_pooling_texts(self, prompts: list[PromptType], params: list[PoolingParams]
                               ) -> list[Optional[list[int]]]:
        """The token ids that process_pooling_inputs would give each plain-text prompt, from one batched call
        of the tokenizer per truncation limit (its Rust side encodes a batch at once: 512 sentences in 19 ms,
        against 31 ms one call each); None where a prompt is not plain text. Checks nothing: what
        is wrong is reported by process_pooling_inputs."""
        encoded: list[Optional[list[int]]] = [None] * len(prompts)
        by_limit: dict[Optional[int], list[int]] = {}
        for i, p in enumerate(params):
            try:
                by_limit.setdefault(self._truncation(p), []).append(i)
            except (ValueError, AttributeError):  # refused by process_pooling_inputs, in the prompts' order
                continue
        for limit, idx in by_limit.items():
            texts = [(i, self.pooling_text(prompts[i])) for i in idx]
            texts = [(i, t) for i, t in texts if t is not None]
            if texts:
                ids = self.tokenizer([t for _, t in texts], truncation=limit is not None, max_length=limit)
                for (i, _), row in zip(texts, ids["input_ids"]):
                    encoded[i] = list(row)
        return encoded

    def process_pooling_inputs(self, request_id: str, prompt: PromptType, params: PoolingParams,
                               arrival_time: Optional[float] = None, priority: int = 0,
                               encoded: Optional[list[int]] = None) -> tuple[Optional[str], EngineCoreRequest]:
        """A pooling request: `prompt` as for generation, or {"prompt": query, "prompt_pair": document} (a
        cross-encoder's two segments, with their token types). Text is truncated to `truncate_prompt_tokens`
        by the tokenizer (its side, its special tokens kept: as sentence-transformers does); token ids keep
        their last n. `encoded`: the text's token ids from tokenize_pooling_texts, where they were made there."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        config = self.pooler_config
        if config is None:
            raise ValueError("embeddings and scores need a pooling model (runner='pooling'); this model runs with "
                             "runner='generate'")
        task = params.task or config.task
        if (config.task == "classify") != (task in ("classify", "score")):
            raise ValueError(f"task {task!r} is not one of this model's: "
                             f"{'classify, score' if config.task == 'classify' else 'embed'}")
        params = params.verify(task, config, self.hidden_size)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        limit = self._truncation(params)
        token_type_ids = None
        if isinstance(prompt, dict) and "prompt_pair" in prompt:
            text = (prompt.get("prompt"), prompt["prompt_pair"])
            if not all(isinstance(t, str) and t for t in text):
                raise ValueError("a scored pair needs two non-empty texts")
            enc = self.tokenizer(*text, truncation="only_second" if limit else False, max_length=limit)
            prompt_text, token_ids = f"{text[0]}\n{text[1]}", list(enc["input_ids"])
            token_type_ids = list(enc["token_type_ids"]) if "token_type_ids" in enc else None
        else:
            text = self.pooling_text(prompt)
            if text is not None and not config.include_prompt and config.default_prompt_name:
                params = replace(params, prompt_tokens_skipped=self._prompt_length())
            if text is not None and (encoded is not None or limit is not None):
                prompt_text = text
                token_ids = encoded if encoded is not None else list(
                    self.tokenizer(text, truncation=True, max_length=limit)["input_ids"])
            else:
                prompt_text, token_ids = self.tokenize_prompt(prompt if text is None else text)
                if isinstance(prompt, dict) and prompt.get("token_type_ids") is not None:  # vLLM's TokensPrompt
                    token_type_ids = list(prompt["token_type_ids"])
                    if len(token_type_ids) != len(token_ids) or not all(t in (0, 1) for t in token_type_ids):
                        raise ValueError(f"token_type_ids must hold a 0 or 1 for each of the {len(token_ids)} "
                                         f"prompt tokens")
                if limit is not None:
                    token_ids = token_ids[-limit:]
                    token_type_ids = token_type_ids[-limit:] if token_type_ids is not None else None
        self._validate(token_ids, None)
        if self.max_prompt_tokens is not None and len(token_ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt is {len(token_ids)} tokens long, more than max_num_batched_tokens "
                             f"({self.max_prompt_tokens}): this model computes a prompt in one step")
        # A pooling request samples nothing (its Request takes max_tokens 0 from its pooling_params); these
        # parameters stay valid ones, as the engine-core process checks them again when it decodes the request.
        sampling = SamplingParams(max_tokens=1, detokenize=False)
        return prompt_text, EngineCoreRequest(request_id, token_ids, sampling, self.eos_token_ids,
                                              arrival_time or time.time(), priority, params, token_type_ids)

    def _validate(self, token_ids: list[int], params: Optional[SamplingParams]) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        problems = []
        if n > self.max_model_len:
            problems.append(f"more than max_model_len ({self.max_model_len})")
        if n > self.kv_capacity_tokens:
            problems.append(f"more than the KV cache holds ({self.kv_capacity_tokens} tokens; raise "
                            f"kv_cache_memory_bytes)")
        if problems:
            raise ValueError(f"prompt is {n} tokens long, " + " and ".join(problems))
        if params is None:
            return
        params.verify_vocab(self.vocab_size)
        if params.thinking_token_budget is not None and not self.reasoning_parser:
            raise ValueError("thinking_token_budget needs a reasoning parser: start the engine with "
                             "reasoning_parser=... (--reasoning-parser), whose end tag the budget forces")
        if params.structured_outputs is not None and self.validate_structured_outputs is not None:
            self.validate_structured_outputs(params.structured_outputs)

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as the model would emit it: at the start of a text and after a space."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

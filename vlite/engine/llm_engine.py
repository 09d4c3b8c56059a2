"""LLMEngine: the synchronous engine API (add_request / step / abort_request).

    add_request: InputProcessor (tokenize, validate) -> OutputProcessor.add_request -> EngineCore
    step:        EngineCore.step() -> OutputProcessor.process_outputs() -> list[RequestOutput]
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Iterable, Optional

import torch

from vlite.config import ParallelConfig
from vlite.engine.arg_utils import EngineArgs
from vlite.core.kv_cache_interface import KVCacheConfig
from vlite.engine.core import EngineCore
from vlite.engine.input_processor import EngineCoreRequest, InputProcessor, PromptType
from vlite.engine.output_processor import OutputProcessor
from vlite.engine.parallel_sampling import ParentRequest
from vlite.executor.start_method import exit_if_bootstrapping
from vlite.lora.request import LoRARequest
from vlite.model_loader import load_tokenizer
from vlite.outputs import RequestOutput
from vlite.pooling_params import PoolingParams
from vlite.profiler import section
from vlite.sampling_params import SamplingParams


def _validate_structured_outputs(params: Any) -> None:
    from vlite.structured_output.backend_xgrammar import validate_structured_outputs

    validate_structured_outputs(params)


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        if engine_args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={engine_args.data_parallel_size}: several engine cores run behind "
                             f"the API server (vlite serve --data-parallel-size); LLM runs one")
        if ParallelConfig(engine_args.tensor_parallel_size, engine_args.distributed_executor_backend).backend == "mp":
            # A spawned worker re-running an unguarded script: stop here, before loading anything.
            exit_if_bootstrapping(f"LLM(tensor_parallel_size={engine_args.tensor_parallel_size})")
        torch.manual_seed(engine_args.seed)
        loaded = engine_args.create_engine_config()
        self.vllm_config = loaded.config
        self.model_config = loaded.config.model_config
        self.resolved_model = loaded.resolved
        # The tokenizer is read while the weights load (their tiling releases the GIL), as the API server's
        # process reads it while the engine-core process loads; the core sees the model's own EOS ids in both.
        # Its thread starts once worker processes are started (a forked worker must not inherit it).
        tokenizer: list[Future] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlite-tokenizer") as pool:
            def start_tokenizer() -> None:
                tokenizer.append(pool.submit(load_tokenizer, loaded.resolved))

            self.engine_core = EngineCore(loaded, lambda: tokenizer[0].result(), while_loading=start_tokenizer)
            self.tokenizer = tokenizer[0].result()
        if engine_args.chat_template is not None:
            self.tokenizer.chat_template = engine_args.chat_template
        eos = set(loaded.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.max_model_len = loaded.config.scheduler_config.max_model_len
        self.num_kv_blocks = loaded.num_kv_blocks
        self.kv_cache_config = KVCacheConfig(loaded.num_kv_blocks, loaded.kv_cache_groups, loaded.num_state_slots,
                                             loaded.num_cached_state_slots)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, loaded.arch.vocab_size,
                                              loaded.kv_capacity_tokens, tuple(sorted(eos)),
                                              _validate_structured_outputs)
        # A pooling model (runner="pooling"): its pipeline, which pooling requests are checked against.
        self.pooler_config = loaded.pooler_config
        self.input_processor.pooler_config = loaded.pooler_config
        self.input_processor.hidden_size = loaded.arch.hidden_size
        self.input_processor.enable_lora = loaded.config.lora_config is not None
        self.input_processor.reasoning_parser = loaded.config.reasoning_config is not None
        self.input_processor.reasoning_budget = engine_args.reasoning_budget
        if not loaded.config.scheduler_config.enable_chunked_prefill:
            self.input_processor.max_prompt_tokens = loaded.config.scheduler_config.max_num_batched_tokens
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending_outputs: list[RequestOutput] = []
        self._children: dict[str, list[str]] = {}  # n > 1 request id -> its children's ids
        self._start_time = time.time()
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    lora_request: Optional[LoRARequest] = None) -> None:
        """A generation request (SamplingParams), under `lora_request`'s adapter if given, or a pooling one
        (PoolingParams with its task set)."""
        if request_id in self.output_processor.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            self.input_processor.check_lora(lora_request, pooling=True)
            prompt_text, request = self.input_processor.process_pooling_inputs(
                request_id, prompt, params, arrival_time, priority)
        else:
            prompt_text, request = self.input_processor.process_inputs(
                request_id, prompt, params or SamplingParams(), arrival_time, priority, lora_request)
        self._add_processed_request(prompt_text, request)

    def _add_processed_request(self, prompt_text: Optional[str], request: EngineCoreRequest) -> None:
        """Register a validated request; n > 1 fans out into n children sharing the prompt."""
        if request.request_id in self._children:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.lora_request is not None:
            self.engine_core.ensure_lora(request.lora_request)  # a bad adapter: a ValueError, nothing registered
        if request.sampling_params.n == 1:
            self._add_child(prompt_text, request, None, 0)
            return
        parent = ParentRequest(request.request_id, request.sampling_params)
        self._children[request.request_id] = parent.child_ids
        for i, child_id in enumerate(parent.child_ids):
            child = dataclasses.replace(request, request_id=child_id, sampling_params=parent.child_params(i))
            self._add_child(prompt_text, child, parent, i)

    def _add_child(self, prompt_text: Optional[str], request: EngineCoreRequest, parent: Optional[ParentRequest],
                   index: int) -> None:
        self.output_processor.add_request(request.request_id, prompt_text, request.prompt_token_ids,
                                          request.sampling_params, request.arrival_time, parent, index)
        self.engine_core.add_request(request)
        self._totals["prompt_tokens"] += len(request.prompt_token_ids)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort; the next step() returns each request's final output with finish_reason='abort'."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [child for req_id in ids for child in self._children.pop(req_id, [req_id])]
        self.engine_core.abort_requests(ids)
        self._pending_outputs.extend(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        engine_core_outputs = self.engine_core.step()
        self._totals["generation_tokens"] += sum(len(o.new_token_ids) for o in engine_core_outputs)
        with section("output_processing"):
            processed = self.output_processor.process_outputs(engine_core_outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        outputs.extend(processed.request_outputs)
        for out in processed.request_outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending_outputs) or self.output_processor.has_unfinished_requests() \
            or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    # ---- LoRA adapters (vLLM's LLMEngine API) ----------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (True if it was not loaded); a ValueError if it cannot be applied."""
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (False if it was not loaded); requests still using it finish under it first."""
        return self.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine_core.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        return self.engine_core.pin_lora(lora_int_id)

    def get_metrics(self) -> dict[str, float]:
        """Engine counters and gauges, named as vLLM's Prometheus metrics (without the prefix)."""
        stats = asdict(self.engine_core.make_stats())
        return {
            "num_requests_running": stats["num_running_reqs"],
            "num_requests_waiting": stats["num_waiting_reqs"],
            "kv_cache_usage_perc": stats["kv_cache_usage"],
            "num_preemptions": stats["num_preemptions"],
            "prefix_cache_queries": stats["prefix_cache_queries"],
            "prefix_cache_hits": stats["prefix_cache_hits"],
            "external_prefix_cache_queries": stats["external_prefix_cache_queries"],
            "external_prefix_cache_hits": stats["external_prefix_cache_hits"],
            "prompt_tokens": self._totals["prompt_tokens"],
            "generation_tokens": self._totals["generation_tokens"],
            "num_kv_blocks": self.num_kv_blocks,
            "num_free_kv_blocks": self.engine_core.kv_cache_manager.get_num_free_blocks(),
        }

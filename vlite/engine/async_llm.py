"""AsyncLLM: the asyncio engine API behind the server.

Input processing (tokenization, validation) and output processing (detokenization, stop strings)
run here, in the API process; the EngineCore busy loop runs in its own process. One background
task pulls EngineCoreOutputs, turns them into RequestOutputs and hands each to its request's queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator, Callable, Optional

from vlite.core.sched.stats import SchedulerStats
from vlite.engine.arg_utils import EngineArgs
from vlite.engine.core_client import AsyncMPClient, DPAsyncMPClient, EngineDeadError
from vlite.engine.core_messages import EngineCoreOutputs
from vlite.engine.input_processor import EngineCoreRequest, InputProcessor, PromptType
from vlite.engine.output_processor import IterationStats, OutputProcessor
from vlite.engine.parallel_sampling import ParentRequest
from vlite.executor.start_method import exit_if_bootstrapping
from vlite.lora.request import LoRARequest
from vlite.model_loader import load_tokenizer, resolve_model
from vlite.outputs import PoolingRequestOutput, RequestOutput
from vlite.pooling_params import PoolingParams
from vlite.sampling_params import SamplingParams

logger = logging.getLogger("vlite")

StatLogger = Callable[[Optional[SchedulerStats], Optional[IterationStats]], None]


class EngineGenerateError(RuntimeError):
    """A request failed inside the engine; other requests are unaffected."""


class EngineBadRequestError(EngineGenerateError):
    """The engine refused a request for its own content (e.g. a grammar that does not compile): a 400."""


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs, stat_loggers: Optional[list[StatLogger]] = None) -> None:
        exit_if_bootstrapping("AsyncLLM")  # in a spawned child re-running an unguarded script: before loading
        self.engine_args = engine_args
        resolved = resolve_model(engine_args.model)
        self.tokenizer = load_tokenizer(resolved)
        if engine_args.chat_template is not None:
            self.tokenizer.chat_template = engine_args.chat_template
        self.model_name = resolved.name
        # One engine core, or data_parallel_size of them behind a router
        self.client = (AsyncMPClient(engine_args) if engine_args.data_parallel_size == 1
                       else DPAsyncMPClient(engine_args))
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor: Optional[InputProcessor] = None
        self.max_model_len = 0
        self.runner = "generate"  # or "pooling" (embeddings, scores): as the engine core loaded the model
        self.pooler_config: Any = None  # a pooling model's vlite.pooling.config.PoolerConfig
        self.latest_stats: Optional[SchedulerStats] = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._children: dict[str, list[str]] = {}
        self._output_task: Optional[asyncio.Task] = None
        self.errored: Optional[str] = None

    @classmethod
    async def create(cls, engine_args: EngineArgs, stat_loggers: Optional[list[StatLogger]] = None) -> AsyncLLM:
        """Start the engine-core process and wait until it has loaded the model."""
        engine = cls(engine_args, stat_loggers)
        try:
            await engine.start()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    async def start(self) -> None:
        ready = await self.client.wait_ready()
        eos = set(ready.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = ready.num_kv_blocks
        self.input_processor = InputProcessor(self.tokenizer, ready.max_model_len, ready.vocab_size,
                                              ready.kv_capacity_tokens, self.eos_token_ids)
        # Pooling requests are checked here as LLMEngine checks them (the PoolerConfig needs no torch).
        self.runner, self.pooler_config = ready.runner, ready.pooler_config
        self.input_processor.pooler_config = ready.pooler_config
        self.input_processor.hidden_size = ready.hidden_size
        self.input_processor.max_prompt_tokens = ready.max_prompt_tokens
        self.input_processor.enable_lora = self.engine_args.enable_lora
        self.input_processor.reasoning_parser = self.engine_args.reasoning_parser is not None
        self.input_processor.reasoning_budget = self.engine_args.reasoning_budget
        self._output_task = asyncio.create_task(self._output_handler(), name="vlite-output-handler")

    @property
    def engine_pid(self) -> Optional[int]:
        return self.client.engine_pid

    @property
    def is_running(self) -> bool:
        return self.errored is None and self.client.is_alive()

    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    # ---- requests -----------------------------------------------------------------------------

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int = 0, lora_request: Optional[LoRARequest] = None
                       ) -> tuple[Optional[str], EngineCoreRequest]:
        """Validate and tokenize (raises ValueError naming the field) without starting anything."""
        assert self.input_processor is not None, "AsyncLLM.start() was not awaited"
        return self.input_processor.process_inputs(request_id, prompt, params, priority=priority,
                                                   lora_request=lora_request)

    def process_pooling_inputs(self, request_id: str, prompt: PromptType, params: PoolingParams,
                               priority: int = 0, encoded: Optional[list[int]] = None
                               ) -> tuple[Optional[str], EngineCoreRequest]:
        """A pooling request validated and tokenized (raises ValueError naming the field), not started;
        `encoded`: its text's ids from tokenize_pooling_texts."""
        assert self.input_processor is not None, "AsyncLLM.start() was not awaited"
        return self.input_processor.process_pooling_inputs(request_id, prompt, params, priority=priority,
                                                           encoded=encoded)

    def tokenize_pooling_texts(self, prompts: list[PromptType], params: list[PoolingParams]
                               ) -> list[Optional[list[int]]]:
        """The plain-text prompts' token ids in one batched tokenizer call (InputProcessor's)."""
        assert self.input_processor is not None, "AsyncLLM.start() was not awaited"
        return self.input_processor.tokenize_pooling_texts(prompts, params)

    async def encode(self, prompt: PromptType | tuple[Optional[str], EngineCoreRequest],
                     pooling_params: Optional[PoolingParams] = None, request_id: str = "",
                     priority: int = 0, lora_request: Optional[LoRARequest] = None) -> PoolingRequestOutput:
        """A pooling request's output (vLLM's AsyncLLM.encode, awaited to its one final output): `prompt` as
        for process_pooling_inputs, or what it returned. Cancelled, it aborts the request. No LoRA adapter:
        they apply to generation only (a pooling model cannot be started with enable_lora)."""
        self.input_processor.check_lora(lora_request, pooling=True)
        if not isinstance(prompt, tuple):
            prompt = self.process_pooling_inputs(request_id, prompt, pooling_params or PoolingParams(), priority)
        if prompt[1].pooling_params is None:
            raise ValueError("encode needs a pooling request (PoolingParams); generate runs the others")
        final: Any = None
        async for out in self.generate(prompt):
            final = out
        if not isinstance(final, PoolingRequestOutput):  # ended without its pooled output
            raise EngineGenerateError(f"request {prompt[1].request_id} ended without a pooled output")
        return final

    async def generate(self, prompt: PromptType | tuple[Optional[str], EngineCoreRequest],
                       sampling_params: Optional[SamplingParams] = None, request_id: str = "",
                       priority: int = 0, lora_request: Optional[LoRARequest] = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs as they come (per `output_kind`); abort if the caller goes away. `lora_request`:
        the adapter to run under (with a prompt; a processed request carries its own). An adapter the engine
        core cannot load fails the request with EngineBadRequestError."""
        if not self.is_running:
            raise EngineDeadError(self.errored or "the engine core is not running")
        if isinstance(prompt, tuple):
            prompt_text, request = prompt
            request_id = request.request_id
        else:
            prompt_text, request = self.process_inputs(request_id, prompt, sampling_params or SamplingParams(),
                                                       priority, lora_request)
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._add_request(prompt_text, request)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def _add_request(self, prompt_text: Optional[str], request: EngineCoreRequest) -> None:
        params = request.sampling_params
        if params.n == 1:
            children = [(request, None, 0)]
        else:
            parent = ParentRequest(request.request_id, params)
            self._children[request.request_id] = parent.child_ids
            children = [(dataclasses.replace(request, request_id=cid, sampling_params=parent.child_params(i)),
                         parent, i) for i, cid in enumerate(parent.child_ids)]
        for child, parent, index in children:
            self.output_processor.add_request(child.request_id, prompt_text, child.prompt_token_ids,
                                              child.sampling_params, child.arrival_time, parent, index)
            await self.client.add_request(child)

    async def abort(self, request_id: str) -> None:
        ids = self._children.pop(request_id, [request_id])
        self.output_processor.abort_requests(ids)
        self._queues.pop(request_id, None)
        try:
            await self.client.abort_requests(ids)
        except EngineDeadError:
            pass

    # ---- output handling ------------------------------------------------------------------------

    async def _output_handler(self) -> None:
        try:
            while True:
                msg = await self.client.get_output()
                if msg is None:
                    if not self.client.is_alive():
                        self._fail_all(f"the engine core process died (exit code {self.client.proc.exitcode})")
                        return
                    continue
                self._handle_outputs(msg)
                if msg.engine_error:
                    self._fail_all(msg.engine_error)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leave requests hanging on a bug here
            logger.exception("output handler failed")
            self._fail_all(f"output handler failed: {e}")

    def _handle_outputs(self, msg: EngineCoreOutputs) -> None:
        if msg.stats is not None:
            self.latest_stats = msg.stats
        iteration_stats = None
        outputs = msg.outputs
        if any(o.error is not None for o in outputs):  # failed alone inside the engine
            for o in outputs:
                if o.error is not None:
                    self._fail_request(o.request_id, o.error, o.bad_request)
            outputs = [o for o in outputs if o.error is None]
        if outputs:
            processed = self.output_processor.process_outputs(outputs)
            iteration_stats = processed.iteration_stats
            for out in processed.request_outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                if out.finished:
                    self._children.pop(out.request_id, None)
            if processed.reqs_to_abort:
                asyncio.ensure_future(self.client.abort_requests(processed.reqs_to_abort))
        for req_id, error in msg.failed_requests.items():
            self._fail_request(req_id, error)
        for stat_logger in self.stat_loggers:
            stat_logger(msg.stats, iteration_stats)

    def _fail_request(self, child_id: str, error: str, bad_request: bool = False) -> None:
        state = self.output_processor.request_states.get(child_id)
        parent_id = state.parent.request_id if state is not None and state.parent is not None else child_id
        self.output_processor.abort_requests(self._children.pop(parent_id, [child_id]))
        queue = self._queues.get(parent_id)
        if queue is not None:
            queue.put_nowait(EngineBadRequestError(error) if bad_request else EngineGenerateError(error))

    def _fail_all(self, error: str) -> None:
        self.errored = error
        logger.error("engine failed: %s", error)
        dead = EngineDeadError(error)
        for queue in self._queues.values():
            queue.put_nowait(dead)
        self.output_processor.abort_requests(list(self.output_processor.request_states))
        self.client.fail_pending_utility(dead)

    # ---- utilities -----------------------------------------------------------------------------

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility("reset_prefix_cache")

    async def get_stats(self) -> dict[str, Any]:
        return await self.client.call_utility("get_stats")

    # ---- LoRA adapters: on every engine core (vLLM's AsyncLLM API) -------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (True if it was not loaded); a ValueError naming the folder and the reason if the
        engine cannot apply it."""
        assert self.input_processor is not None, "AsyncLLM.start() was not awaited"
        self.input_processor.check_lora(lora_request)  # LoRA on and a LoRARequest, before the engine core is asked
        return await self.client.call_utility("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (False if it was not loaded); requests still using it finish under it first."""
        return await self.client.call_utility("remove_lora", lora_int_id)

    async def list_loras(self) -> set[int]:
        return set(await self.client.call_utility("list_loras") or ())

    async def pin_lora(self, lora_int_id: int) -> bool:
        return await self.client.call_utility("pin_lora", lora_int_id)

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(self.errored or "the engine core is not running")

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError("the engine is shutting down"))
        self.client.shutdown()


"""EngineCore: the step loop. schedule -> execute_model -> sample_tokens -> update_from_output.

The model runs behind an executor (vlite.executor): in this process, or in one worker process per
tensor-parallel rank.
"""

from __future__ import annotations

import logging
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from vlite.core.kv_cache_manager import EncoderOnlyKVCacheManager, KVCacheManager
from vlite.core.sched.output import EngineCoreOutput, SchedulerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.core.sched.stats import SchedulerStats
from vlite.engine.input_processor import EngineCoreRequest
from vlite.executor import Executor, ExecutorDeadError
from vlite.kv_connector.base import KVConnectorRole
from vlite.kv_connector.factory import create_kv_connector
from vlite.lora.request import LoRARequest
from vlite.profiler import section
from vlite.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from vlite.config import LoadedEngineConfig
    from vlite.reasoning.tracker import ReasoningTracker
    from vlite.structured_output.manager import StructuredOutputManager
    from vlite.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, loaded: LoadedEngineConfig, tokenizer: Optional[Callable[[], Any]] = None,
                 while_loading: Optional[Callable[[], None]] = None) -> None:
        """`tokenizer`: a function returning the frontend's tokenizer (for structured outputs), else it is
        loaded here on first use. `while_loading`: see Executor.create."""
        cfg = loaded.config
        cache = cfg.cache_config
        # An all-sliding-window model (Mistral) frees the KV blocks behind the window as requests run.
        self.kv_cache_manager = (
            KVCacheManager(loaded.num_kv_blocks, cache.block_size, cache.enable_prefix_caching,
                           sliding_window=loaded.arch.kv_sliding_window, num_state_slots=loaded.num_state_slots,
                           num_cached_state_slots=loaded.num_cached_state_slots,
                           group_windows=loaded.kv_group_windows) if loaded.arch.is_causal
            else EncoderOnlyKVCacheManager(cache.block_size))  # encoders keep no KV cache
        # A KV store outside the engine (--kv-offload-dir): its scheduler side; workers hold their own side.
        self.kv_connector = create_kv_connector(loaded, KVConnectorRole.SCHEDULER)
        self.scheduler = Scheduler(cfg.scheduler_config, self.kv_cache_manager, cfg.speculative_config,
                                   cfg.lora_config, kv_connector=self.kv_connector)
        self.lora_config = cfg.lora_config
        # Adapters loaded once without error, by lora_int_id: a request naming one is not checked again (the
        # runner reloads an evicted one by itself), and an id or name cannot change meaning while it is known.
        self._loras: dict[int, LoRARequest] = {}
        self._removing: set[int] = set()  # removed while requests used them: unloaded once those finish
        # Where the model runs (this process, or worker processes): the core talks only to the executor.
        self.executor = Executor.create(loaded, while_loading)
        # The in-process runner with the uni executor (introspection, tests); None with workers.
        self.model_runner: Optional[ModelRunner] = getattr(self.executor, "model_runner", None)
        self._loaded_resolved = loaded.resolved
        self._tokenizer_source = tokenizer
        self._tokenizer: Any = None
        self._vocab_size = loaded.arch.vocab_size
        self._eos_token_ids = tuple(loaded.eos_token_ids)
        self._structured_output_manager: Optional[StructuredOutputManager] = None
        reasoning = cfg.reasoning_config
        self._reasoning_parser_cls = reasoning.parser_class() if reasoning is not None else None

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Made on the first request with structured outputs (xgrammar is optional)."""
        if self._structured_output_manager is None:
            from vlite.structured_output.backend_xgrammar import import_xgrammar
            from vlite.structured_output.manager import StructuredOutputManager

            import_xgrammar()  # fail the request now, with the install hint, if it is missing
            self._structured_output_manager = StructuredOutputManager(
                self._load_tokenizer, self._vocab_size, self._eos_token_ids)
        return self._structured_output_manager

    def reasoning_tracker(self, req: Request) -> Optional[ReasoningTracker]:
        """The request's reasoning phase as the tokens come (None without --reasoning-parser): where its output
        starts is read off its prompt's end, as the server and LLM.chat read it."""
        if self._reasoning_parser_cls is None:
            return None
        from vlite.reasoning.tracker import ReasoningTracker

        return ReasoningTracker.for_prompt(self._reasoning_parser_cls, self._load_tokenizer(), req.prompt_token_ids,
                                           req.output_token_ids)

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from vlite.model_loader import load_tokenizer

            self._tokenizer = (self._tokenizer_source() if self._tokenizer_source is not None
                               else load_tokenizer(self._loaded_resolved))
        return self._tokenizer

    def add_request(self, request: EngineCoreRequest) -> None:
        req = Request(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, eos_token_ids=request.eos_token_ids,
            arrival_time=request.arrival_time, priority=request.priority, pooling_params=request.pooling_params,
            token_type_ids=request.token_type_ids, lora_request=request.lora_request)
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.lora_request is not None:
            self.ensure_lora(request.lora_request)  # a bad adapter fails this request now, before any work
        budget = req.sampling_params.thinking_token_budget
        if budget is not None and self._reasoning_parser_cls is None:
            raise ValueError("thinking_token_budget needs a reasoning parser (start the engine with "
                             "reasoning_parser=..., --reasoning-parser): it is the parser's end tag that is forced")
        if req.sampling_params.structured_outputs is not None:
            # Compiled on the manager's threads; the request waits in WAITING_FOR_FSM meanwhile.
            self.structured_output_manager.grammar_init(req)
        if req.sampling_params.structured_outputs is not None or budget is not None:
            # A thinking model's grammar constrains the answer, not the thinking before it; a thinking budget
            # counts the block's tokens and the scheduler forces its end tag once they reach the budget.
            req.reasoning = self.reasoning_tracker(req)
        self.scheduler.add_request(req)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras / pin_lora) ------------------------------

    def ensure_lora(self, lora_request: LoRARequest) -> None:
        """Make sure a request's adapter can run: loaded now if it was never loaded; a ValueError naming the
        adapter if LoRA is off, the folder is not an adapter vlite can apply, or its id or name means another."""
        known = self._loras.get(lora_request.lora_int_id)
        if known is None or not _same_adapter(known, lora_request):
            self.add_lora(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every rank; True if it was not loaded. Raises ValueError (LoRAAdapterError for a
        folder vlite cannot apply); the engine goes on."""
        if self.lora_config is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: LoRA is not enabled; start the engine with "
                             f"enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        known = self._loras.get(lora_request.lora_int_id)
        if known is not None and not _same_adapter(known, lora_request):
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is adapter {known.lora_name!r} "
                             f"({known.lora_path}); remove it before giving the id to {lora_request.lora_name!r} "
                             f"({lora_request.lora_path})")
        for other in self._loras.values():
            if other.lora_name == lora_request.lora_name and other.lora_int_id != lora_request.lora_int_id:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is loaded with lora_int_id "
                                 f"{other.lora_int_id}, not {lora_request.lora_int_id}")
        if lora_request.lora_int_id in self._removing and not any(
                _same_adapter(r.lora_request, lora_request) for r in self.scheduler.requests.values()
                if r.lora_request is not None and r.lora_request.lora_int_id == lora_request.lora_int_id):
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is still used by the requests of the adapter "
                             f"removed under it; give {lora_request.lora_name!r} another id")
        added = self.executor.add_lora(lora_request)
        self._loras[lora_request.lora_int_id] = lora_request
        self._removing.discard(lora_request.lora_int_id)  # named again before its removal came due: kept
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False if it was not loaded. While unfinished requests use it (running or waiting)
        they finish under it and it is unloaded after them (vLLM reloads it from its folder instead, which may be
        gone by then); meanwhile its id and name are free to be given again."""
        if self._loras.pop(lora_int_id, None) is None and lora_int_id not in self.executor.list_loras():
            return False
        if self._lora_in_use(lora_int_id):
            self._removing.add(lora_int_id)
            return True
        return self.executor.remove_lora(lora_int_id)

    def _lora_in_use(self, lora_int_id: int) -> bool:
        return any(r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id
                   for r in self.scheduler.requests.values())

    def _finish_removals(self) -> None:
        """Unload the adapters removed while in use whose last requests have finished."""
        for lora_int_id in [i for i in self._removing if not self._lora_in_use(i)]:
            self._removing.discard(lora_int_id)
            if lora_int_id not in self._loras:  # not named again meanwhile
                self.executor.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.executor.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep an adapter loaded (never evicted for another)."""
        return self.executor.pin_lora(lora_int_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        with section("schedule"):
            scheduler_output = self.scheduler.schedule()
        manager = self._structured_output_manager
        if scheduler_output.is_empty and manager is not None and manager.has_pending():
            # Only requests waiting for their grammar: let the compile threads have the CPU.
            manager.wait_for_compilation(0.005)
        executor = self.executor
        try:
            executor.execute_model(scheduler_output)
            grammar_output = None
            if manager is not None and scheduler_output.sample_req_ids:
                with section("grammar_bitmask"):
                    grammar_output = manager.grammar_bitmask(self.scheduler.requests, scheduler_output.sample_req_ids,
                                                             scheduler_output.scheduled_spec_decode_tokens)
            with section("sample"):
                model_output = executor.sample_tokens(grammar_output)
        except ExecutorDeadError:
            raise  # no step can run any more: the engine core fails every request (core_proc)
        except Exception as e:
            return self._handle_step_failure(scheduler_output, e)
        with section("update_from_output"):
            outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.scheduler.on_step_succeeded(scheduler_output)
        if self._removing:
            self._finish_removals()
        return outputs

    def _handle_step_failure(self, scheduler_output: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A request whose processing raises fails alone; the others resume (see Scheduler.handle_step_failure)."""
        scheduled = list(scheduler_output.num_scheduled_tokens)
        logger.error("engine step with %d request(s) raised: %s", len(scheduled),
                     "".join(traceback.format_exception(error)))
        self.executor.reset()
        failed = self.scheduler.handle_step_failure(scheduler_output)
        if not failed:
            logger.warning("running %d request(s) alone to find the one that fails", len(scheduled))
        message = f"{type(error).__name__}: {error}"
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason=str(FinishReason.ERROR),
                                 error=message) for r in failed]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the executor's workers (none with the uni executor)."""
        self.executor.shutdown()


def _same_adapter(a: LoRARequest, b: LoRARequest) -> bool:
    return (a.lora_name, a.lora_int_id, a.lora_path) == (b.lora_name, b.lora_int_id, b.lora_path)

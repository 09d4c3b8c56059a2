"""EngineCore: the step loop. schedule -> execute_model -> sample_tokens -> update_from_output."""

from __future__ import annotations

import logging
import traceback
from typing import Iterable

from vlite.core.kv_cache_manager import KVCacheManager
from vlite.core.sched.output import EngineCoreOutput, SchedulerOutput
from vlite.core.sched.scheduler import Scheduler, SchedulerStats
from vlite.engine.arg_utils import LoadedEngineConfig
from vlite.engine.input_processor import EngineCoreRequest
from vlite.profiler import section
from vlite.request import FinishReason, Request, RequestStatus
from vlite.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, loaded: LoadedEngineConfig) -> None:
        cfg = loaded.config
        cache = cfg.cache_config
        # An all-sliding-window model (Mistral) frees the KV blocks behind the window as requests run.
        self.kv_cache_manager = KVCacheManager(loaded.num_kv_blocks, cache.block_size, cache.enable_prefix_caching,
                                               sliding_window=loaded.arch.kv_sliding_window)
        self.scheduler = Scheduler(cfg.scheduler_config, self.kv_cache_manager)
        self.model_runner = ModelRunner(
            loaded.arch, loaded.weights, loaded.torch_dtype, loaded.num_kv_blocks, cache.block_size,
            cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_model_len, loaded.eos_token_ids,
            loaded.quantization)
        loaded.weights = {}  # the model holds what it needs; drop the loader's references

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, eos_token_ids=request.eos_token_ids,
            arrival_time=request.arrival_time, priority=request.priority))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        with section("schedule"):
            scheduler_output = self.scheduler.schedule()
        try:
            self.model_runner.execute_model(scheduler_output)
            with section("sample"):
                model_output = self.model_runner.sample_tokens()
        except Exception as e:
            return self._handle_step_failure(scheduler_output, e)
        with section("update_from_output"):
            outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.scheduler.on_step_succeeded(scheduler_output)
        return outputs

    def _handle_step_failure(self, scheduler_output: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A request whose processing raises fails alone; the others resume (see Scheduler.handle_step_failure)."""
        scheduled = list(scheduler_output.num_scheduled_tokens)
        logger.error("engine step with %d request(s) raised: %s", len(scheduled),
                     "".join(traceback.format_exception(error)))
        self.model_runner.reset()
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

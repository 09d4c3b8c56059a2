"""Scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill/decode phases. Each request's `num_computed_tokens` catches up with its
`num_tokens` (prompt + output); a long prompt is computed in chunks across steps while other
requests decode in the same batch. Pure Python bookkeeping: no torch here.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Optional

from vlite.config import LoRAConfig, SchedulerConfig, SpeculativeConfig
from vlite.core.kv_cache_manager import KVCacheManager
from vlite.core.sched.fault_isolation import FaultIsolation
from vlite.core.sched.output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                                     SchedulerOutput)
from vlite.core.sched.remote_kv import RemoteKVScheduling
from vlite.core.sched.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from vlite.core.sched.stats import SchedulerStats, SpecDecodingStats
from vlite.core.sched.utils import check_stop, forced_tokens, usable_drafts
from vlite.kv_connector.base import KVConnectorBase, KVConnectorStats
from vlite.request import FinishReason, Request, RequestStatus


class Scheduler(FaultIsolation, RemoteKVScheduling):
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 speculative_config: Optional[SpeculativeConfig] = None,
                 lora_config: Optional[LoRAConfig] = None, kv_connector: Optional[KVConnectorBase] = None) -> None:
        self.config = scheduler_config
        # KV blocks from outside the engine (vlite.kv_connector; its scheduler side), and their loads.
        self.kv_connector = kv_connector
        self._init_remote_kv()
        # With LoRA: at most lora_config.max_loras distinct adapters among the running requests (the runner's slots).
        self.lora_config = lora_config
        self.spec_decoding_stats = SpecDecodingStats() if speculative_config is not None else None
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.policy = SchedulingPolicy.parse(scheduler_config.policy)
        self.waiting: RequestQueue = create_request_queue(self.policy)
        # Requests passed over for a reason of their own (e.g. their blocks do not fit yet); they
        # are retried first so that they keep their place without blocking the ones behind them.
        self.skipped_waiting: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Finished since the last schedule(); the runner drops them from its batch.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Fault isolation: after a step raised with several requests in it, these run one at a
        # time (head first) until each has survived a sampling step alone or failed alone.
        self.suspects: deque[str] = deque()
        # Outputs produced outside a step's sampling (requests failed while waiting), sent with the next ones.
        self.pending_outputs: list[EngineCoreOutput] = []
        # Requests with a thinking budget whose block may still be open: each step's forced tokens (utils).
        self.budgeted: set[str] = set()

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.reasoning is not None and request.sampling_params.thinking_token_budget is not None:
            self.budgeted.add(request.request_id)
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string). Unknown or finished ids are ignored."""
        assert RequestStatus.is_finished(status)
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                for queue in (self.waiting, self.skipped_waiting):
                    if request in queue:
                        queue.remove_request(request)
                        break
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _fail_invalid(self, request: Request, error: str) -> None:
        """A request that cannot run as asked (e.g. its grammar did not compile) ends with an error
        that the client caused (a 400 on the server), reported with the next step's outputs."""
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        self.pending_outputs.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                     finish_reason=str(FinishReason.ERROR), error=error,
                                                     bad_request=True))

    def _free_request(self, request: Request) -> None:
        if request.structured_output_request is not None:
            request.structured_output_request.free()
        if self._release_remote_kv(request):  # else freed once its load is done
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self.budgeted.discard(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        while self.suspects and self.suspects[0] not in self.requests:  # finished or aborted meanwhile
            self.suspects.popleft()
        if self.suspects:
            return self._schedule_isolated(self.requests[self.suspects[0]])
        return self._schedule()

    def _schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.new_step()
        token_budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_blocks_of: dict[str, tuple[list[int], ...]] = {}  # per KV cache group
        scheduled_running: list[Request] = []
        scheduled_new: list[NewRequestData] = []
        preempted_req_ids: set[str] = set()
        scheduled_spec: dict[str, list[int]] = {}

        # Phase 1: running requests, in order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            # Draft tokens (speculative decoding) are scheduled after the request's next token.
            num_new_tokens = self._cap_new_tokens(request, request.num_tokens_with_spec - request.num_computed_tokens,
                                                  token_budget, request.num_computed_tokens)
            if num_new_tokens == 0:
                req_index += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                victim = self._select_preemption_victim(req_index)
                self.running.remove(victim)
                self._preempt(victim)
                preempted_req_ids.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself: nothing else fits either
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            if request.spec_token_ids:
                # Drafts past the budget are dropped: the next step brings fresh ones.
                num_spec = request.num_computed_tokens + num_new_tokens - request.num_tokens
                if num_spec > 0:
                    scheduled_spec[request.request_id] = request.spec_token_ids[:num_spec]
                request.spec_token_ids = []
            new_blocks_of[request.request_id] = new_blocks.block_ids()
            token_budget -= num_new_tokens
            req_index += 1

        # Phase 2: waiting requests, only when nothing had to be preempted.
        if not preempted_req_ids:
            token_budget = self._schedule_waiting(token_budget, num_scheduled_tokens, scheduled_new)

        cached = CachedRequestData()
        for request in scheduled_running:
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_blocks_of[request.request_id])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            cached.num_blocks_before.append(self.kv_cache_manager.get_num_blocks(request.request_id)
                                            - len(new_blocks_of[request.request_id][0]))
        sample_req_ids, prompt_done_req_ids = set(), set()
        state_saves = []
        for req_id, n in num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            save = self.kv_cache_manager.schedule_state_save(request)
            if save is not None:
                state_saves.append(save)
            if request.num_computed_tokens >= request.num_tokens:
                (prompt_done_req_ids if request.max_tokens == 0 else sample_req_ids).add(req_id)
        output = SchedulerOutput(
            scheduled_new_reqs=scheduled_new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_req_ids,
            sample_req_ids=sample_req_ids,
            prompt_done_req_ids=prompt_done_req_ids,
            scheduled_spec_decode_tokens=scheduled_spec,
            state_saves=state_saves,
            forced_token_ids=forced_tokens(self.requests, self.budgeted, sample_req_ids, scheduled_spec),
            num_common_prefix_blocks=(self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0], len(self.running)) if self.running else 0),
        )
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output, self.requests,
                                                                                  self.kv_cache_manager)
        self.finished_req_ids = set()
        return output

    def _schedule_waiting(self, token_budget: int, num_scheduled_tokens: dict[str, int],
                          scheduled_new: list[NewRequestData]) -> int:
        kv = self.kv_cache_manager
        step_skipped_waiting = create_request_queue(self.policy)
        num_partial_prefills = sum(
            1 for r in self.running
            if kv.is_partial_prefill(r, r.num_computed_tokens + num_scheduled_tokens.get(r.request_id, 0)))
        # The adapters of every running request (not only this step's): no step can then hold more than max_loras.
        running_loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        while token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            queue = self._select_waiting_queue_for_scheduling()
            if queue is None:
                break
            request = queue.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self._try_promote_remote_kv(request):
                # Its blocks are still loading: pass it over without holding up the others.
                queue.pop_request()
                step_skipped_waiting.prepend_request(request)
                continue
            if request.status == RequestStatus.WAITING_FOR_FSM:
                so_request = request.structured_output_request
                assert so_request is not None
                if not so_request.is_ready():
                    # Its grammar is still compiling: pass it over without holding up the others.
                    queue.pop_request()
                    step_skipped_waiting.prepend_request(request)
                    continue
                error = so_request.error()
                if error is not None:
                    queue.pop_request()
                    self._fail_invalid(request, error)
                    continue
                request.status = RequestStatus.WAITING
            lora = request.lora_request
            if (lora is not None and self.lora_config is not None and lora.lora_int_id not in running_loras
                    and len(running_loras) >= self.lora_config.max_loras):
                # Every adapter slot is taken: wait for one to free, letting base-model requests and those of
                # the running adapters go ahead.
                queue.pop_request()
                step_skipped_waiting.prepend_request(request)
                continue
            computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
            num_external_tokens = self._lookup_remote_kv(request, num_computed_tokens)
            if num_external_tokens:
                # Found outside the engine: load it in the background, holding the blocks meanwhile.
                self._start_remote_load(request, computed_blocks, num_computed_tokens, num_external_tokens)
                queue.pop_request()
                step_skipped_waiting.prepend_request(request)
                continue
            num_new_tokens = self._cap_new_tokens(request, request.num_tokens - num_computed_tokens, token_budget,
                                                  num_computed_tokens)
            is_partial = kv.is_partial_prefill(request, num_computed_tokens + num_new_tokens)
            new_blocks = None
            # Unchunked prompts (encoders) wait for a step with room for all of them.
            if not (is_partial and (num_partial_prefills >= self.config.max_num_partial_prefills
                                    or not self.config.enable_chunked_prefill)):
                new_blocks = kv.allocate_slots(request, num_new_tokens, num_computed_tokens, computed_blocks,
                                               record_stats=request.request_id not in self._kv_promoted)
            if new_blocks is None:
                # Cannot start now for a reason of its own: step aside for the requests behind it.
                queue.pop_request()
                step_skipped_waiting.prepend_request(request)
                continue
            queue.pop_request()
            self._note_admitted(request, num_computed_tokens)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens
                request.first_scheduled_time = time.time()
            num_partial_prefills += is_partial
            if lora is not None:
                running_loras.add(lora.lora_int_id)
            scheduled_new.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=kv.get_group_block_ids(request.request_id),
                num_computed_tokens=num_computed_tokens,
                pooling_params=request.pooling_params,
                token_type_ids=request.token_type_ids,
                lora_request=request.lora_request,
                state_slot=kv.state_slot(request.request_id),
                state_restore_from=kv.state_restore_source(request.request_id),
            ))
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        # prepend_request reversed their order; prepend_requests reverses it back.
        if step_skipped_waiting:
            self.skipped_waiting.prepend_requests(step_skipped_waiting)
        return token_budget

    def _cap_new_tokens(self, request: Request, num_new_tokens: int, token_budget: int,
                        num_computed_tokens: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        # recurrent-state models end a step where the prefix cache saves a state
        return self.kv_cache_manager.cap_new_tokens(request, num_computed_tokens, min(num_new_tokens, token_budget))

    def _select_waiting_queue_for_scheduling(self) -> Optional[RequestQueue]:
        """The queue with the better head. FCFS: the earlier arrival, since a preempted request at
        the head of `waiting` may have arrived before the skipped ones. PRIORITY: (priority, arrival)."""
        if self.skipped_waiting and self.waiting:
            a, b = self.skipped_waiting.peek_request(), self.waiting.peek_request()
            if self.policy == SchedulingPolicy.FCFS:
                a_key, b_key = (a.arrival_time,), (b.arrival_time,)
            else:
                a_key, b_key = (a.priority, a.arrival_time), (b.priority, b.arrival_time)
            return self.skipped_waiting if a_key <= b_key else self.waiting
        return self.skipped_waiting or self.waiting or None

    def _select_preemption_victim(self, req_index: int) -> Request:
        """FCFS: the last running request. PRIORITY: the lowest-priority (latest) one.

        Only requests not yet scheduled in this step are candidates (the current one included),
        so no block filled in this step is released with a hash but without its K/V.
        """
        if self.policy == SchedulingPolicy.FCFS:
            return self.running[-1]
        return max(self.running[req_index:], key=lambda r: (r.priority, r.arrival_time))

    def _release_for_recompute(self, request: Request) -> None:
        """Drop the request's KV blocks; it will compute its tokens again when scheduled."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []

    def _preempt(self, request: Request) -> None:
        """Recompute-mode preemption: drop the KV blocks, go back to the head of the queue."""
        self._release_for_recompute(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    # ---- update --------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        self._update_from_kv_output(model_runner_output.kv_connector_output)
        stopped = False
        requests = self.requests
        logprobs, prompt_logprobs = model_runner_output.logprobs, model_runner_output.prompt_logprobs
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, new_token_ids in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            request = requests.get(req_id)
            if request is None or request.status > RequestStatus.PREEMPTED:  # gone or finished meanwhile
                continue
            spec = scheduled_spec.get(req_id)
            if spec:
                # The rejected drafts' K/V were written but are not the request's: compute from there again.
                request.num_computed_tokens -= len(spec) + 1 - len(new_token_ids)
                assert self.spec_decoding_stats is not None
                self.spec_decoding_stats.observe(len(spec), len(new_token_ids) - 1)
            so_request = request.structured_output_request
            for n, token_id in enumerate(new_token_ids):
                request.output_token_ids.append(token_id)
                request.all_token_ids.append(token_id)
                stopped_here = check_stop(request, self.max_model_len)
                # The thinking block of a reasoning model is not the grammar's: it takes the answer's tokens.
                in_answer = request.reasoning is None or request.reasoning.accept(token_id)
                if so_request is not None and not stopped_here and in_answer:
                    # The matcher follows the tokens the request keeps; a complete grammar ends it.
                    if not so_request.accept_tokens(req_id, [token_id]):
                        request.status = RequestStatus.FINISHED_ERROR
                        stopped_here = True
                    elif so_request.is_terminated():
                        request.status = RequestStatus.FINISHED_STOPPED
                        stopped_here = True
                if stopped_here:
                    new_token_ids = new_token_ids[:n + 1]
                    break
            output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_token_ids,
                new_logprobs=logprobs.get(req_id) if logprobs else None,
                new_prompt_logprobs=prompt_logprobs.get(req_id) if prompt_logprobs else None,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                first_scheduled_time=request.first_scheduled_time if len(request.output_token_ids) == 1 else None,
            )
            if request.status > RequestStatus.PREEMPTED:
                output.finish_reason = str(request.get_finished_reason())
                output.stop_reason = request.stop_reason
                self._free_request(request)
                stopped = True
            elif self.spec_decoding_stats is not None:
                self._set_spec_tokens(request, model_runner_output.spec_token_ids.get(req_id))
            outputs.append(output)
        # Prompt logprobs of chunks that sampled nothing still travel to the output processor.
        done = scheduler_output.prompt_done_req_ids
        if prompt_logprobs:
            sampled = set(model_runner_output.req_ids)
            for req_id, plp in prompt_logprobs.items():
                if req_id not in sampled and req_id not in done and req_id in self.requests:
                    outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[], new_prompt_logprobs=plp))
        # max_tokens 0: the prompt is computed (and scored), the request ends without a token; a pooling
        # request ends with its pooled output ("pooling finished").
        pooled = model_runner_output.pooler_output
        for req_id in done:
            request = requests.get(req_id)
            if request is None or request.is_finished:
                continue
            pooling = request.pooling_params is not None
            request.status = RequestStatus.FINISHED_STOPPED if pooling else RequestStatus.FINISHED_LENGTH_CAPPED
            outputs.append(EngineCoreOutput(
                request_id=req_id, new_token_ids=[], finish_reason=str(request.get_finished_reason()),
                new_prompt_logprobs=prompt_logprobs.get(req_id) if prompt_logprobs else None,
                num_cached_tokens=max(request.num_cached_tokens, 0), first_scheduled_time=request.first_scheduled_time,
                pooling_output=pooled.get(req_id) if pooling else None))
            self._free_request(request)
            stopped = True
        if stopped:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _set_spec_tokens(self, request: Request, draft_token_ids: Optional[list[int]]) -> None:
        """Keep the drafts the request can use, and free the blocks that neither its tokens nor its
        next drafts occupy (those only rejected drafts filled)."""
        request.spec_token_ids = usable_drafts(request, draft_token_ids or [], self.max_model_len)
        self.kv_cache_manager.free_blocks_beyond(request, request.num_tokens + len(request.spec_token_ids))

    # ---- stats ---------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        pc = self.kv_cache_manager.prefix_cache_stats
        ext = self.kv_connector.get_stats() if self.kv_connector is not None else KVConnectorStats()
        running_loras: dict[str, int] = {}
        waiting_loras: dict[str, int] = {}
        if self.lora_config is not None:
            for requests, counts in ((self.running, running_loras),
                                     ((*self.waiting, *self.skipped_waiting), waiting_loras)):
                for r in requests:
                    if r.lora_request is not None:
                        counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.skipped_waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            external_prefix_cache_queries=ext.queries,
            external_prefix_cache_hits=ext.hits,
            spec_decoding=self.spec_decoding_stats.copy() if self.spec_decoding_stats is not None else None,
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
            max_lora=self.lora_config.max_loras if self.lora_config is not None else 0,
        )

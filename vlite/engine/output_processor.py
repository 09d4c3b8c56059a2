"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenized, stop strings, logprobs).

Runs in the API process: it owns one RequestState per request and turns token deltas from the
engine core into what the user asked for (cumulative, delta or final-only outputs). A stop
string found here ends the request; the caller aborts it in the engine core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from vlite.core.sched.output import EngineCoreOutput
from vlite.engine.detokenizer import IncrementalDetokenizer
from vlite.engine.parallel_sampling import ParentRequest
from vlite.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, PromptLogprobs, RequestOutput,
                           SampleLogprobs)
from vlite.request import FinishReason
from vlite.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Optional[IncrementalDetokenizer]
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[SampleLogprobs] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    cumulative_logprob: Optional[float] = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0  # tokens already returned in DELTA mode
    sent_logprobs: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    queue_time: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    parent: Optional[ParentRequest] = None  # set for the children of an n > 1 request
    index: int = 0


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: Optional[float]


@dataclass
class IterationStats:
    """Latency samples of one batch of engine outputs, for the metrics loggers."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # of requests that produced their first token in this batch
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    reqs_to_abort: list[str]  # ended by a stop string here; still running in the engine core
    iteration_stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: Optional[float] = None,
                    parent: Optional[ParentRequest] = None, index: int = 0) -> None:
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        state = RequestState(request_id, prompt, prompt_token_ids, params, detok, arrival_time or time.time(),
                             parent=parent, index=index)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.request_states[request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests aborted by the user; their last output says finish_reason='abort'."""
        outputs = []
        for req_id in request_ids:
            state = self.request_states.get(req_id)
            if state is not None:
                state.finish_reason = str(FinishReason.ABORT)
                out = self._make_request_output(state, finished=True)
                if out is not None:
                    outputs.append(out)
                del self.request_states[req_id]
        return outputs

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        request_outputs: list[RequestOutput | PoolingRequestOutput] = []
        reqs_to_abort: list[str] = []
        stats = IterationStats()
        now = time.time()
        for eco in engine_core_outputs:
            state = self.request_states.get(eco.request_id)
            if state is None:
                continue  # aborted meanwhile
            state.num_cached_tokens = eco.num_cached_tokens
            if eco.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._to_logprobs(eco.new_prompt_logprobs))
            if eco.first_scheduled_time is not None:
                state.queue_time = max(eco.first_scheduled_time - state.arrival_time, 0.0)
            finish_reason, stop_reason = eco.finish_reason, eco.stop_reason
            if eco.pooling_output is not None:  # a pooling request ends with its pooled output
                request_outputs.append(PoolingRequestOutput(
                    eco.request_id, PoolingOutput(eco.pooling_output), state.prompt_token_ids, True, state.prompt,
                    eco.num_cached_tokens))
                stats.num_prompt_tokens += len(state.prompt_token_ids)
                stats.finished_requests.append(FinishedRequestStats(
                    finish_reason or str(FinishReason.STOP), now - state.arrival_time, len(state.prompt_token_ids), 0,
                    state.queue_time))
                del self.request_states[eco.request_id]
                continue
            new_ids = eco.new_token_ids
            if state.detokenizer is not None and new_ids:
                before = state.detokenizer.num_output_tokens
                stop_str = state.detokenizer.update(new_ids, finish_reason == str(FinishReason.STOP))
                if stop_str is not None:
                    # Several ids in one step (accepted speculative drafts): those after the one that
                    # completed the stop string are dropped, as if the ids had come one step at a time.
                    kept = state.detokenizer.num_output_tokens - before
                    if finish_reason is None or kept < len(new_ids):
                        if finish_reason is None:
                            reqs_to_abort.append(eco.request_id)
                        finish_reason, stop_reason = str(FinishReason.STOP), stop_str
                    new_ids = new_ids[:kept]
            if new_ids:
                stats.num_generation_tokens += len(new_ids)
                if state.first_token_time is None:
                    state.first_token_time = now
                    stats.time_to_first_tokens.append(now - state.arrival_time)
                    stats.num_prompt_tokens += len(state.prompt_token_ids)
                else:
                    stats.inter_token_latencies.append(now - (state.last_token_time or now))
                state.last_token_time = now
                state.token_ids.extend(new_ids)
                if eco.new_logprobs is not None and state.logprobs is not None:
                    new = self._to_logprobs(eco.new_logprobs)[:len(new_ids)]
                    state.logprobs.extend(new)
                    for token_id, position in zip(new_ids, new):
                        state.cumulative_logprob += position[token_id].logprob
            if finish_reason is not None:
                state.finish_reason, state.stop_reason = finish_reason, stop_reason
            finished = finish_reason is not None
            out = self._make_request_output(state, finished)
            if out is not None:
                request_outputs.append(out)
            if finished:
                if state.first_token_time is None and finish_reason == str(FinishReason.LENGTH):
                    stats.num_prompt_tokens += len(state.prompt_token_ids)  # max_tokens 0: prompt only
                stats.finished_requests.append(FinishedRequestStats(
                    str(state.finish_reason), now - state.arrival_time, len(state.prompt_token_ids),
                    len(state.token_ids), state.queue_time))
                del self.request_states[eco.request_id]
        return OutputProcessorOutput(request_outputs, reqs_to_abort, stats)

    def _to_logprobs(self, lists: tuple[list[list[int]], list[list[float]], list[int]]) -> SampleLogprobs:
        """(ids, logprobs, sampled ranks) per position -> {id: Logprob}; column 0 is the chosen token."""
        out: SampleLogprobs = []
        for ids, lps, rank in zip(*lists):
            position: dict[int, Logprob] = {}
            for j, (token_id, lp) in enumerate(zip(ids, lps)):
                if token_id not in position:
                    position[token_id] = Logprob(lp, rank if j == 0 else j, self._decode_token(token_id))
            out.append(position)
        return out

    def _decode_token(self, token_id: int) -> Optional[str]:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_request_output(self, state: RequestState, finished: bool) -> Optional[RequestOutput]:
        out = self._make_child_output(state, finished)
        if out is not None and state.parent is not None:
            return state.parent.aggregate(state.index, out)
        return out

    def _make_child_output(self, state: RequestState, finished: bool) -> Optional[RequestOutput]:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished and state.parent is None:
            return None
        delta = kind == RequestOutputKind.DELTA
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.get_next_output_text(finished, delta)
            if finished and state.detokenizer.stop_str_hit is not None and state.stop_reason is None \
                    and state.finish_reason != str(FinishReason.ABORT):
                # The stop string sat in text held back until the end.
                state.finish_reason, state.stop_reason = str(FinishReason.STOP), state.detokenizer.stop_str_hit
        token_ids = state.token_ids[state.sent_tokens:] if delta else list(state.token_ids)
        logprobs = state.logprobs
        if delta:
            state.sent_tokens = len(state.token_ids)
            if logprobs is not None:
                logprobs = logprobs[state.sent_logprobs:]
                state.sent_logprobs = len(state.logprobs or [])
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs, finish_reason=state.finish_reason if finished else None,
            stop_reason=state.stop_reason if finished else None)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=[completion], finished=finished, prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics={"arrival_time": state.arrival_time, "first_token_time": state.first_token_time,
                     "last_token_time": state.last_token_time})

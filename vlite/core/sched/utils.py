"""Per-request checks the scheduler runs on each step's output (vLLM's v1/core/sched/utils.py)."""

from __future__ import annotations

from typing import Iterable

from vlite.reasoning import CONTENT
from vlite.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether `request` is finished after its newest output token (EOS, a stop token id past min_tokens, max_tokens
    or max_model_len reached); sets its status (and stop_reason) when it is."""
    params = request.sampling_params
    num_output_tokens = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
    if len(request.all_token_ids) >= max_model_len or num_output_tokens >= max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def usable_drafts(request: Request, drafts: list[int], max_model_len: int) -> list[int]:
    """The leading drafts `request` can take: the next step yields up to 1 + len(drafts) tokens, none past
    max_tokens or max_model_len, under a thinking budget none from a token it forces, and under a grammar only
    drafts it accepts."""
    if not drafts:
        return drafts
    params = request.sampling_params
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
    room = min(max_tokens - request.num_output_tokens, max_model_len - request.num_tokens) - 1
    drafts = drafts[:max(room, 0)]
    so_request, reasoning = request.structured_output_request, request.reasoning
    if drafts and reasoning is not None and params.thinking_token_budget is not None:
        drafts = reasoning.drafts_within_budget(drafts, params.thinking_token_budget)
    if not drafts or so_request is None:
        return drafts
    if reasoning is not None and reasoning.phase != CONTENT:
        return reasoning.drafts_in_reasoning(drafts)  # the grammar starts after the thinking
    return so_request.valid_prefix(drafts)


def forced_tokens(requests: dict[str, Request], budgeted: set[str], sample_req_ids: Iterable[str],
                  scheduled_spec: dict[str, list[int]]) -> dict[str, int]:
    """Thinking budgets: the token each sampled request in `budgeted` must take next (its end tag's next token,
    once its block holds thinking_token_budget tokens); those past their block leave `budgeted`.

    The state is the scheduler's (the request's ReasoningTracker, fed the tokens it keeps), not the runner's:
    it is what preemption, fault recovery and speculative decoding already keep right, and the runner gets
    a plain req_id -> token map with the step, like the grammar bitmask. Drafts stop short of a forced token
    (usable_drafts), so only a request's last logits row, the one after its drafts, can be forced.
    """
    if not budgeted:
        return {}
    forced: dict[str, int] = {}
    for req_id in budgeted.intersection(sample_req_ids):
        request = requests[req_id]
        reasoning = request.reasoning
        if reasoning is None or reasoning.phase == CONTENT:
            budgeted.discard(req_id)  # the block is closed: nothing left to force
            continue
        token = reasoning.forced_token(request.sampling_params.thinking_token_budget or 0,
                                       scheduled_spec.get(req_id, ()))
        if token is not None:
            forced[req_id] = token
    return forced

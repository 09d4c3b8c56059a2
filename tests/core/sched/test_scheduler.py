"""Scheduling traces of vlite.core.sched.scheduler.Scheduler on a fake model runner (no torch).

Each step: schedule() -> a fake ModelRunnerOutput with one deterministic token for every request in
scheduler_output.sample_req_ids -> update_from_output(). The trace records, per step, which
requests were scheduled with how many tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import pytest

from vlite.config import SchedulerConfig
from vlite.core.kv_cache_manager import KVCacheManager
from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.request import Request, RequestStatus
from vlite.sampling_params import SamplingParams

TOKEN = 7  # what the fake model samples unless told otherwise


def make_scheduler(num_blocks: int = 100, block_size: int = 4, enable_caching: bool = True,
                   **config) -> Scheduler:
    config.setdefault("max_model_len", 1000)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size, enable_caching))


_arrival = [0.0]


def make_req(rid: str, prompt, *, priority: int = 0, eos: tuple[int, ...] = (), arrival: Optional[float] = None,
             **sp) -> Request:
    """`prompt`: a token list, or a length (tokens derived from the id so prompts do not share blocks)."""
    if isinstance(prompt, int):
        base = 1000 * (sum(map(ord, rid)) % 97 + 1)
        prompt = list(range(base, base + prompt))
    sp.setdefault("max_tokens", 4)
    if arrival is None:
        _arrival[0] += 1.0
        arrival = _arrival[0]
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(**sp),
                   eos_token_ids=eos, arrival_time=arrival, priority=priority)


class Trace:
    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []  # req_id -> tokens scheduled, per step
        self.new: list[list[str]] = []  # req_ids admitted (or resumed) per step
        self.preempted: list[set[str]] = []
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.stop_reason: dict[str, object] = {}
        self.scheduler_outputs: list[SchedulerOutput] = []

    def first_step(self, rid: str) -> int:
        return next(i for i, s in enumerate(self.steps) if rid in s)

    def steps_of(self, rid: str) -> list[int]:
        return [i for i, s in enumerate(self.steps) if rid in s]


TokenFn = Callable[[Request], "int | list[int]"]


def step(sched: Scheduler, trace: Trace, token_fn: Optional[TokenFn] = None) -> SchedulerOutput:
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= sched.config.max_num_seqs
    trace.steps.append(dict(so.num_scheduled_tokens))
    trace.new.append([d.req_id for d in so.scheduled_new_reqs])
    trace.preempted.append(set(so.preempted_req_ids))
    trace.scheduler_outputs.append(so)
    req_ids, sampled = [], []
    for rid in so.num_scheduled_tokens:  # scheduling order
        if rid in so.sample_req_ids:
            req = sched.requests[rid]
            tok = token_fn(req) if token_fn else TOKEN
            req_ids.append(rid)
            sampled.append(tok if isinstance(tok, list) else [tok])
    outs = sched.update_from_output(so, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))
    for out in outs:
        trace.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            trace.finish[out.request_id] = out.finish_reason
            trace.stop_reason[out.request_id] = out.stop_reason
    return so


def run(sched: Scheduler, trace: Optional[Trace] = None, token_fn: Optional[TokenFn] = None,
        max_steps: int = 200) -> Trace:
    trace = trace or Trace()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return trace
        step(sched, trace, token_fn)
    raise AssertionError(f"not finished after {max_steps} steps: {trace.steps[-5:]}")


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks
    assert kv.req_to_blocks == {}
    assert sched.requests == {} and sched.running == []
    assert not sched.waiting and not sched.skipped_waiting


def sequence(tokens: list[int]) -> TokenFn:
    """Sample tokens[i] as the i-th output token of every request (then TOKEN)."""
    return lambda req: tokens[req.num_output_tokens] if req.num_output_tokens < len(tokens) else TOKEN


# ---- ordering ----------------------------------------------------------------------------------


def test_fcfs_order_one_at_a_time():
    sched = make_scheduler(max_num_seqs=1)
    for rid in "abc":
        sched.add_request(make_req(rid, 5, max_tokens=2))
    trace = run(sched)
    assert trace.steps == [{"a": 5}, {"a": 1}, {"b": 5}, {"b": 1}, {"c": 5}, {"c": 1}]
    assert trace.outputs == {"a": [TOKEN] * 2, "b": [TOKEN] * 2, "c": [TOKEN] * 2}
    assert trace.finish == {"a": "length", "b": "length", "c": "length"}
    assert_all_free(sched)


def test_fcfs_batch_and_admission_order():
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=10, max_num_partial_prefills=3)
    for rid, n in (("a", 4), ("b", 4), ("c", 4)):
        sched.add_request(make_req(rid, n, max_tokens=3))
    trace = run(sched)
    # c gets the 2 tokens left of the budget (a partial prefill), then the rest.
    assert trace.steps[0] == {"a": 4, "b": 4, "c": 2}
    assert list(trace.steps[0]) == ["a", "b", "c"]
    assert trace.steps[1] == {"a": 1, "b": 1, "c": 2}
    assert trace.steps[2] == {"a": 1, "b": 1, "c": 1}
    assert trace.steps[3] == {"c": 1}
    assert all(len(v) == 3 for v in trace.outputs.values())
    assert_all_free(sched)


def test_priority_later_higher_priority_runs_first():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_req("low1", 3, priority=5, max_tokens=1))
    sched.add_request(make_req("low2", 3, priority=5, max_tokens=1))
    sched.add_request(make_req("high", 3, priority=0, max_tokens=1))
    trace = run(sched)
    assert [list(s) for s in trace.steps] == [["high"], ["low1"], ["low2"]]
    assert_all_free(sched)


def test_priority_arrival_while_running_does_not_preempt_but_jumps_queue():
    sched = make_scheduler(max_num_seqs=1, policy="PRIORITY")  # case-insensitive
    sched.add_request(make_req("a", 3, priority=2, max_tokens=3))
    sched.add_request(make_req("b", 3, priority=2, max_tokens=1))
    trace = Trace()
    step(sched, trace)
    sched.add_request(make_req("c", 3, priority=1, max_tokens=1))
    run(sched, trace)
    assert [list(s) for s in trace.steps] == [["a"], ["a"], ["a"], ["c"], ["b"]]


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_req("a", 3, priority=9, max_tokens=1))
    sched.add_request(make_req("b", 3, priority=0, max_tokens=1))
    trace = run(sched)
    assert [list(s) for s in trace.steps] == [["a"], ["b"]]


# ---- preemption --------------------------------------------------------------------------------


def test_preempted_request_resumes_first_fcfs():
    # 4 blocks of 4 tokens. a and b hold 2 blocks each once they pass 4 tokens; a's 9th token needs
    # a 5th block, so b (the last running request) is preempted; c waits for a free seat.
    sched = make_scheduler(num_blocks=4, block_size=4, enable_caching=False, max_num_seqs=2)
    sched.add_request(make_req("a", 4, max_tokens=6))
    sched.add_request(make_req("b", 4, max_tokens=6))
    sched.add_request(make_req("c", 4, max_tokens=2))
    trace = run(sched)
    assert trace.steps == [{"a": 4, "b": 4}] + [{"a": 1, "b": 1}] * 4 + [{"a": 1}, {"b": 9, "c": 4}, {"c": 1}]
    assert trace.preempted[5] == {"b"}
    # b comes back as a new request ahead of c, recomputing its prompt and its 5 outputs.
    assert trace.new[6] == ["b", "c"]
    data = trace.scheduler_outputs[6].scheduled_new_reqs[0]
    assert data.req_id == "b" and data.num_computed_tokens == 0
    assert data.output_token_ids == [TOKEN] * 5
    # Everyone ends with the right number of tokens; b's outputs are not duplicated by the recompute.
    assert trace.outputs == {"a": [TOKEN] * 6, "b": [TOKEN] * 6, "c": [TOKEN] * 2}
    assert trace.finish == {"a": "length", "b": "length", "c": "length"}
    assert sched.num_preemptions == 1 and sched.make_stats().num_preemptions == 1
    assert_all_free(sched)


def test_preempted_request_resumes_before_a_later_skipped_one_fcfs():
    # 5 blocks of 2 tokens. c arrives while a and b run and does not fit, so it is skipped; then a
    # preempts b. b arrived before c, so under FCFS b resumes first, although c is in
    # skipped_waiting and b at the head of waiting.
    sched = make_scheduler(num_blocks=5, block_size=2, enable_caching=False, max_num_seqs=3)
    sched.add_request(make_req("a", 2, max_tokens=8))
    sched.add_request(make_req("b", 2, max_tokens=8))
    trace = Trace()
    step(sched, trace)  # a, b: one block each
    sched.add_request(make_req("c", 6, max_tokens=1))  # 3 blocks
    step(sched, trace)
    assert [r.request_id for r in sched.skipped_waiting] == ["c"]
    step(sched, trace)
    step(sched, trace)
    assert trace.preempted[3] == {"b"}
    assert [r.request_id for r in sched.waiting] == ["b"]
    step(sched, trace)  # neither fits; they keep their arrival order
    assert [r.request_id for r in sched.skipped_waiting] == ["b", "c"]
    run(sched, trace)
    assert trace.first_step("b") < trace.first_step("c")
    resume = next(i for i in range(4, len(trace.steps)) if "b" in trace.steps[i])
    assert trace.steps[resume] == {"b": 5}  # 2 prompt + 3 outputs recomputed
    assert resume < trace.first_step("c")
    assert trace.outputs == {"a": [TOKEN] * 8, "b": [TOKEN] * 8, "c": [TOKEN]}
    assert_all_free(sched)


def test_preempted_request_reuses_its_cached_prefix():
    # 6 blocks of 4; a and b (8-token prompts) both grow to 3 blocks, then a preempts b. b's
    # freed prompt blocks stay cached, so it resumes with a prefix hit and recomputes the rest.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2)
    sched.add_request(make_req("a", 8, max_tokens=9))
    sched.add_request(make_req("b", 8, max_tokens=9))
    trace = run(sched)
    assert trace.preempted[5] == {"b"}
    resume = next(i for i in range(6, len(trace.steps)) if "b" in trace.new[i])
    data = trace.scheduler_outputs[resume].scheduled_new_reqs[0]
    assert data.num_computed_tokens == 8  # its two prompt blocks
    assert trace.steps[resume] == {"b": 8 + 5 - 8}  # prompt + 5 outputs, minus the hit
    assert trace.outputs == {"a": [TOKEN] * 9, "b": [TOKEN] * 9}
    assert_all_free(sched)


@pytest.mark.parametrize("policy, victim", [("priority", "lo"), ("fcfs", "hi")])
def test_preemption_victim(policy, victim):
    # lo runs first; hi (better priority) joins a step later. When the pool runs dry, priority
    # preempts the worst-priority request, FCFS the last admitted one.
    sched = make_scheduler(num_blocks=4, block_size=4, enable_caching=False, max_num_seqs=2, policy=policy)
    sched.add_request(make_req("lo", 4, priority=3, max_tokens=8))
    trace = Trace()
    step(sched, trace)
    sched.add_request(make_req("hi", 4, priority=0, max_tokens=8))
    run(sched, trace)
    assert [p for p in trace.preempted if p] == [{victim}]
    pre = next(i for i, p in enumerate(trace.preempted) if p)
    survivor = "hi" if victim == "lo" else "lo"
    # The survivor decodes in every step after the preemption until it is done; the victim
    # comes back only then (it no longer fits beside it).
    last = max(trace.steps_of(survivor))
    assert all(trace.steps[i] == {survivor: 1} for i in range(pre + 1, last + 1))
    assert trace.first_step(victim) < pre < min(i for i in trace.steps_of(victim) if i > pre)
    assert trace.outputs == {"lo": [TOKEN] * 8, "hi": [TOKEN] * 8}
    assert_all_free(sched)


# ---- skipping for lack of KV blocks ------------------------------------------------------------


def test_skipped_request_does_not_block_smaller_ones():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    sched.add_request(make_req("a", 12, max_tokens=2))  # 3 blocks
    sched.add_request(make_req("big", 16, max_tokens=1))  # 4 blocks: does not fit beside a
    sched.add_request(make_req("small", 4, max_tokens=1))  # 1 block (+1 to sample into)
    trace = Trace()
    step(sched, trace)
    assert trace.steps[0] == {"a": 12, "small": 4}
    assert [r.request_id for r in sched.skipped_waiting] == ["big"]
    assert not sched.waiting
    assert sched.requests["big"].status == RequestStatus.WAITING
    run(sched, trace)
    # big runs once a has finished and freed its blocks, ahead of anything behind it.
    assert trace.first_step("big") > max(trace.steps_of("a"))
    assert trace.steps[trace.first_step("big")]["big"] == 16
    assert trace.finish == {"a": "length", "big": "length", "small": "length"}
    assert_all_free(sched)


def test_skipped_requests_keep_their_order():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    sched.add_request(make_req("a", 12, max_tokens=2))  # 3 blocks
    sched.add_request(make_req("x", 8, max_tokens=1))
    sched.add_request(make_req("y", 8, max_tokens=1))
    trace = Trace()
    step(sched, trace)
    assert [r.request_id for r in sched.skipped_waiting] == ["x", "y"]
    step(sched, trace)
    assert [r.request_id for r in sched.skipped_waiting] == ["x", "y"]
    run(sched, trace)
    first = trace.first_step("x")
    assert trace.new[first] == ["x", "y"]  # admitted together once a is done, x first
    assert_all_free(sched)


# ---- chunked prefill and budgets ---------------------------------------------------------------


def test_decodes_run_every_step_while_a_long_prompt_is_chunked():
    sched = make_scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=4)
    sched.add_request(make_req("a", 2, max_tokens=20))
    sched.add_request(make_req("b", 2, max_tokens=20))
    trace = Trace()
    step(sched, trace)
    assert trace.steps[0] == {"a": 2, "b": 2}
    sched.add_request(make_req("long", 30, max_tokens=1))
    while "long" not in trace.finish:
        so = step(sched, trace)
        if "long" in so.num_scheduled_tokens and "long" not in so.sample_req_ids:
            assert so.num_scheduled_tokens["a"] == 1 and so.num_scheduled_tokens["b"] == 1
    long_steps = [trace.steps[i]["long"] for i in trace.steps_of("long")]
    assert long_steps == [4] * 7 + [2]  # capped at the threshold, 30 tokens in all
    for i in trace.steps_of("long"):
        assert trace.steps[i]["a"] == 1 and trace.steps[i]["b"] == 1
    # Only the step that reaches the end of the prompt samples.
    samples = [i for i in trace.steps_of("long") if "long" in trace.scheduler_outputs[i].sample_req_ids]
    assert samples == [trace.steps_of("long")[-1]]
    assert trace.outputs["long"] == [TOKEN]


def test_chunk_takes_what_is_left_of_the_budget_without_threshold():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_req("a", 2, max_tokens=20))
    trace = Trace()
    step(sched, trace)
    sched.add_request(make_req("long", 20, max_tokens=1))
    for _ in range(3):
        step(sched, trace)
    assert trace.steps[1:] == [{"a": 1, "long": 7}] * 2 + [{"a": 1, "long": 6}]


def test_token_budget_respected():
    sched = make_scheduler(max_num_batched_tokens=10, max_num_partial_prefills=2)
    sched.add_request(make_req("a", 25, max_tokens=2))
    sched.add_request(make_req("b", 3, max_tokens=2))
    trace = run(sched)
    assert trace.steps == [{"a": 10}, {"a": 10}, {"a": 5, "b": 3}, {"a": 1, "b": 1}]
    assert all(sum(s.values()) <= 10 for s in trace.steps)


def test_budget_shared_by_many_decodes():
    sched = make_scheduler(max_num_batched_tokens=3, max_num_seqs=10)
    for rid in "abcde":
        sched.add_request(make_req(rid, 1, max_tokens=2))
    trace = run(sched)
    assert all(sum(s.values()) <= 3 for s in trace.steps)
    assert trace.steps[0] == {"a": 1, "b": 1, "c": 1}
    assert all(len(v) == 2 for v in trace.outputs.values()) and len(trace.outputs) == 5


def test_max_num_partial_prefills_respected():
    sched = make_scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=4, max_num_partial_prefills=1)
    sched.add_request(make_req("a", 20, max_tokens=1))
    sched.add_request(make_req("b", 20, max_tokens=1))
    sched.add_request(make_req("c", 2, max_tokens=1))  # fits whole: not a partial prefill
    trace = Trace()
    step(sched, trace)
    assert trace.steps[0] == {"a": 4, "c": 2}
    assert [r.request_id for r in sched.skipped_waiting] == ["b"]
    run(sched, trace)
    for so in trace.scheduler_outputs:
        # A chunk that does not reach the end of its prompt samples nothing.
        mid_prompt = [r for r in so.num_scheduled_tokens if r not in so.sample_req_ids]
        assert len(mid_prompt) <= 1
    assert trace.steps_of("a") == [0, 1, 2, 3, 4]
    assert trace.first_step("b") == 4  # b starts in the step that completes a's prompt
    assert_all_free(sched)

    sched = make_scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=4, max_num_partial_prefills=2)
    sched.add_request(make_req("a", 20, max_tokens=1))
    sched.add_request(make_req("b", 20, max_tokens=1))
    sched.add_request(make_req("c", 20, max_tokens=1))
    trace = Trace()
    step(sched, trace)
    assert trace.steps[0] == {"a": 4, "b": 4}


def test_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abcd":
        sched.add_request(make_req(rid, 2, max_tokens=2))
    trace = run(sched)
    assert trace.steps == [{"a": 2, "b": 2}, {"a": 1, "b": 1}, {"c": 2, "d": 2}, {"c": 1, "d": 1}]


# ---- prefix caching through the scheduler -----------------------------------------------------


def test_prefix_hit_skips_cached_tokens():
    sched = make_scheduler(block_size=4)
    prompt = list(range(10, 20))
    sched.add_request(make_req("a", prompt, max_tokens=1))
    trace = run(sched)
    sched.add_request(make_req("b", prompt[:8] + [99, 98], max_tokens=1))
    sched.add_request(make_req("c", prompt[:8], max_tokens=1))  # fully cached: recompute a block
    run(sched, trace)
    assert trace.steps[-1] == {"b": 2, "c": 4}
    data = {d.req_id: d for d in trace.scheduler_outputs[-1].scheduled_new_reqs}
    assert data["b"].num_computed_tokens == 8 and data["c"].num_computed_tokens == 4
    stats = sched.make_stats()
    assert stats.prefix_cache_queries == 10 + 10 + 8 and stats.prefix_cache_hits == 12
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0


def test_num_cached_tokens_reported():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_req("a", list(range(9)), max_tokens=1))
    run(sched)
    sched.add_request(make_req("b", list(range(9)), max_tokens=2))
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[[1]]))
    assert outs[0].num_cached_tokens == 8
    assert sched.requests["b"].num_cached_tokens == 8


# ---- aborts ------------------------------------------------------------------------------------


def test_finish_requests_from_every_queue_frees_blocks():
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    sched.add_request(make_req("a", 8, max_tokens=10))  # 2 blocks
    sched.add_request(make_req("big", 16, max_tokens=10))  # 4 blocks: skipped
    sched.add_request(make_req("c", 4, max_tokens=10))  # 1 block
    sched.add_request(make_req("d", 4, max_tokens=10))  # max_num_seqs reached: stays waiting
    trace = Trace()
    step(sched, trace)
    assert trace.steps[0] == {"a": 8, "c": 4}
    assert [r.request_id for r in sched.running] == ["a", "c"]
    assert [r.request_id for r in sched.skipped_waiting] == ["big"]
    assert [r.request_id for r in sched.waiting] == ["d"]
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == 2

    reqs = {rid: sched.requests[rid] for rid in ("a", "big", "d")}
    finished = sched.finish_requests(["big", "d", "a"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["big", "d", "a"]
    for req in reqs.values():
        assert req.status == RequestStatus.FINISHED_ABORTED and str(req.get_finished_reason()) == "abort"
    assert list(sched.requests) == ["c"]
    assert [r.request_id for r in sched.running] == ["c"]
    assert not sched.waiting and not sched.skipped_waiting
    assert kv.get_num_free_blocks() == 4 and "a" not in kv.req_to_blocks
    so = step(sched, trace)
    assert so.finished_req_ids == {"a", "big", "d"}
    assert so.num_scheduled_tokens == {"c": 1}
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)
    assert sched.schedule().finished_req_ids == {"c"}
    assert sched.schedule().finished_req_ids == set()


def test_abort_unknown_or_finished_is_noop():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3, max_tokens=1))
    trace = run(sched)
    a_done = trace.finish["a"]
    sched.add_request(make_req("b", 3, max_tokens=5))
    step(sched, trace)
    kv = sched.kv_cache_manager
    free_before = kv.get_num_free_blocks()
    assert sched.finish_requests(["zzz", "a"], RequestStatus.FINISHED_ABORTED) == []
    assert a_done == "length"
    assert kv.get_num_free_blocks() == free_before and list(sched.requests) == ["b"]
    # Aborting the same id twice in one call aborts it once.
    b = sched.requests["b"]
    assert sched.finish_requests(["b", "b"], RequestStatus.FINISHED_ABORTED) == [b]
    assert sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == []
    assert_all_free(sched)


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=4, block_size=4, enable_caching=False, max_num_seqs=2)
    sched.add_request(make_req("a", 4, max_tokens=10))
    sched.add_request(make_req("b", 4, max_tokens=10))
    trace = Trace()
    while not any(trace.preempted):
        step(sched, trace)
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    assert sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)[0].request_id == "b"
    run(sched, trace)
    assert len(trace.outputs["a"]) == 10
    assert_all_free(sched)


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("a", 3))


def test_empty_schedule():
    sched = make_scheduler()
    so = sched.schedule()
    assert so.is_empty and so.num_scheduled_tokens == {} and so.sample_req_ids == set()
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0


# ---- stop conditions ---------------------------------------------------------------------------


def test_stop_on_eos():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3, eos=(2,), max_tokens=10))
    trace = run(sched, token_fn=sequence([5, 2, 6]))
    assert trace.outputs["a"] == [5, 2]
    assert trace.finish["a"] == "stop" and trace.stop_reason["a"] is None
    assert_all_free(sched)


def test_stop_on_stop_token_ids():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3, eos=(2,), max_tokens=10, stop_token_ids=[9]))
    trace = run(sched, token_fn=sequence([5, 9, 6]))
    assert trace.outputs["a"] == [5, 9]
    assert trace.finish["a"] == "stop" and trace.stop_reason["a"] == 9


def test_stop_on_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3, eos=(2,), max_tokens=3))
    trace = run(sched)
    assert trace.outputs["a"] == [TOKEN] * 3 and trace.finish["a"] == "length"
    assert trace.stop_reason["a"] is None


def test_min_tokens_suppresses_eos_and_stop_tokens():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3, eos=(2,), max_tokens=10, min_tokens=3, stop_token_ids=[9]))
    trace = run(sched, token_fn=sequence([2, 9, 2, 2]))
    assert trace.outputs["a"] == [2, 9, 2] and trace.finish["a"] == "stop"
    sched.add_request(make_req("b", 3, eos=(2,), max_tokens=10, min_tokens=2, stop_token_ids=[9]))
    trace = run(sched, token_fn=sequence([9, 9, 9]))
    assert trace.outputs["b"] == [9, 9] and trace.stop_reason["b"] == 9


def test_ignore_eos():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3, eos=(2,), max_tokens=4, ignore_eos=True))
    trace = run(sched, token_fn=sequence([2, 2, 2, 2, 2]))
    assert trace.outputs["a"] == [2, 2, 2, 2] and trace.finish["a"] == "length"
    # stop_token_ids still apply.
    sched.add_request(make_req("b", 3, eos=(2,), max_tokens=4, ignore_eos=True, stop_token_ids=[2]))
    trace = run(sched, token_fn=sequence([2, 2]))
    assert trace.outputs["b"] == [2] and trace.finish["b"] == "stop" and trace.stop_reason["b"] == 2


def test_stop_at_max_model_len():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_req("a", 6, max_tokens=100))
    sched.add_request(make_req("b", 5, max_tokens=None))  # no max_tokens: max_model_len bounds it
    trace = run(sched)
    assert trace.outputs["a"] == [TOKEN] * 2 and trace.finish["a"] == "length"
    assert trace.outputs["b"] == [TOKEN] * 3 and trace.finish["b"] == "length"


def test_multi_token_output_truncated_at_stop():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3, eos=(2,), max_tokens=10))
    sched.add_request(make_req("b", 3, max_tokens=2))
    trace = run(sched, token_fn=lambda req: [5, 2, 6] if req.request_id == "a" else [4, 4, 4])
    assert trace.outputs == {"a": [5, 2], "b": [4, 4]}
    assert trace.finish == {"a": "stop", "b": "length"}
    assert_all_free(sched)


def test_output_for_unknown_or_finished_request_ignored():
    sched = make_scheduler()
    sched.add_request(make_req("a", 3, max_tokens=5))
    so = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so, ModelRunnerOutput(req_ids=["a", "ghost"], sampled_token_ids=[[1], [2]]))
    assert outs == []


# ---- configuration -----------------------------------------------------------------------------


def test_unknown_policy_rejected():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(policy="lifo")
    cfg = SchedulerConfig()
    object.__setattr__(cfg, "policy", "lifo")  # bypass the config's own validation
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(cfg, KVCacheManager(10, 4))


def test_config_validation():
    for kwargs in ({"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"max_model_len": 0},
                   {"max_num_partial_prefills": 0}, {"long_prefill_token_threshold": -1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SchedulerConfig(**kwargs)
    assert dataclasses.replace(SchedulerConfig(), policy=" Priority ").policy == " Priority "


# ---- max_tokens 0 ------------------------------------------------------------------------------


def test_max_tokens_zero_finishes_with_its_prompt_without_sampling():
    """A prompt-only request (max_tokens=0, prompt_logprobs): chunked like any prompt, never in
    sample_req_ids, finished "length" by the step that completes its prompt, blocks freed."""
    sched = make_scheduler(max_num_batched_tokens=6, max_num_partial_prefills=2)
    sched.add_request(make_req("a", 10, max_tokens=0, prompt_logprobs=1))
    sched.add_request(make_req("b", 3, max_tokens=2))
    sched.add_request(make_req("c", 1, max_tokens=0, prompt_logprobs=0))
    trace = run(sched)
    assert trace.steps[:2] == [{"a": 6}, {"a": 4, "b": 2}]
    assert [so.prompt_done_req_ids for so in trace.scheduler_outputs][:4] == [set(), {"a"}, {"c"}, set()]
    assert all(not so.sample_req_ids & {"a", "c"} for so in trace.scheduler_outputs)
    assert "a" in trace.scheduler_outputs[2].finished_req_ids  # the runner drops its row next step
    assert trace.outputs == {"a": [], "b": [TOKEN] * 2, "c": []}
    assert trace.finish == {"a": "length", "b": "length", "c": "length"}
    assert_all_free(sched)

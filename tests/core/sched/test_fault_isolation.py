"""A request whose processing raises inside a step fails alone; the others finish as if nothing happened.

The fake runner raises whenever a "poisoned" request is scheduled (optionally only once it has
produced some tokens). The scheduler must find the culprit by running suspects alone, fail it
with FINISHED_ERROR, and finish every other request with exactly the tokens of a fault-free run.
"""

from __future__ import annotations

from typing import Callable

import pytest

from tests.core.sched.test_scheduler import TOKEN, Trace, assert_all_free, make_req, make_scheduler, run
from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.request import Request, RequestStatus

Poison = Callable[[Request], bool]


def token_of(req: Request) -> int:
    """Deterministic per request and position, so a resumed request must continue exactly."""
    return 100 + (sum(map(ord, req.request_id)) * 7 + req.num_output_tokens * 13) % 50


def faulty_step(sched: Scheduler, trace: Trace, poison: Poison) -> SchedulerOutput:
    so = sched.schedule()
    trace.steps.append(dict(so.num_scheduled_tokens))
    if any(poison(sched.requests[r]) for r in so.num_scheduled_tokens):
        for req in sched.handle_step_failure(so):
            trace.finish[req.request_id] = "error"
        return so
    req_ids = [r for r in so.num_scheduled_tokens if r in so.sample_req_ids]
    sampled = [[token_of(sched.requests[r])] for r in req_ids]
    for out in sched.update_from_output(so, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)):
        trace.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            trace.finish[out.request_id] = out.finish_reason
    sched.on_step_succeeded(so)
    return so


def run_faulty(sched: Scheduler, poison: Poison, max_steps: int = 500) -> Trace:
    trace = Trace()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return trace
        faulty_step(sched, trace, poison)
    raise AssertionError(f"not finished after {max_steps} steps")


def add(sched: Scheduler, specs: list[tuple[str, int, int]], **kw) -> None:
    for rid, n_prompt, max_tokens in specs:
        sched.add_request(make_req(rid, n_prompt, max_tokens=max_tokens, **kw))


SPECS = [("a", 9, 6), ("b", 5, 4), ("bad", 7, 5), ("c", 12, 8), ("d", 3, 3)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("fault_after", [0, 2])  # raise at the prefill, or at the 3rd decode
@pytest.mark.parametrize("caching", [True, False])
def test_poisoned_request_fails_alone(policy, fault_after, caching):
    def make() -> Scheduler:
        s = make_scheduler(num_blocks=40, block_size=4, enable_caching=caching, policy=policy,
                           max_num_batched_tokens=16, max_num_partial_prefills=4)
        add(s, SPECS)
        return s

    expected = run(make(), token_fn=token_of)
    sched = make()
    trace = run_faulty(sched, lambda r: r.request_id == "bad" and r.num_output_tokens >= fault_after)
    assert trace.finish.pop("bad") == "error"
    del expected.finish["bad"], expected.outputs["bad"]
    trace.outputs.pop("bad", None)
    assert trace.finish == expected.finish  # every other request finished, none lost
    assert trace.outputs == expected.outputs  # with the tokens of a fault-free run
    assert sched.num_preemptions == 0  # recovery is not reported as preemption
    assert not sched.suspects
    assert_all_free(sched)


def test_request_alone_in_step_fails_at_once():
    sched = make_scheduler()
    add(sched, [("bad", 5, 4)])
    trace = run_faulty(sched, lambda r: True)
    assert trace.steps == [{"bad": 5}]
    assert trace.finish == {"bad": "error"}
    assert_all_free(sched)


def test_isolation_runs_suspects_one_at_a_time_then_batches_again():
    sched = make_scheduler(max_num_batched_tokens=64)
    add(sched, [("a", 4, 6), ("bad", 4, 6), ("c", 4, 6)])
    trace = run_faulty(sched, lambda r: r.request_id == "bad")
    assert trace.steps[0] == {"a": 4, "bad": 4, "c": 4}  # raised
    # a alone (cleared), bad alone (raised: failed), c alone (cleared, nothing left to isolate)
    assert trace.steps[1:4] == [{"a": 4}, {"bad": 4}, {"c": 4}]
    # a was put back to let the others run alone; it resumes with c in one batch, recomputing its
    # 5 tokens (bad's failure emptied the prefix cache).
    assert trace.steps[4] == {"c": 1, "a": 5}
    assert all(len(s) == 2 for s in trace.steps[5:])
    assert trace.finish == {"a": "length", "bad": "error", "c": "length"}
    assert_all_free(sched)


def test_two_poisoned_requests():
    sched = make_scheduler(max_num_batched_tokens=64)
    add(sched, [("a", 4, 3), ("bad1", 4, 3), ("c", 6, 3), ("bad2", 5, 3), ("e", 2, 3)])
    trace = run_faulty(sched, lambda r: r.request_id.startswith("bad"))
    assert trace.finish == {"a": "length", "bad1": "error", "c": "length", "bad2": "error", "e": "length"}
    assert {k: len(v) for k, v in trace.outputs.items()} == {"a": 3, "c": 3, "e": 3}
    assert_all_free(sched)


def test_abort_during_isolation_and_new_arrivals_wait():
    sched = make_scheduler(max_num_batched_tokens=64)
    add(sched, [("a", 4, 5), ("b", 4, 5), ("bad", 4, 5)])
    trace = Trace()
    poison = lambda r: r.request_id == "bad"  # noqa: E731
    faulty_step(sched, trace, poison)  # raises: a, b, bad become suspects
    assert list(sched.suspects) == ["a", "b", "bad"]
    assert all(r.status == RequestStatus.PREEMPTED for r in sched.requests.values())
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_req("late", 4, max_tokens=2))
    faulty_step(sched, trace, poison)
    assert trace.steps[-1] == {"a": 4}
    faulty_step(sched, trace, poison)
    assert trace.steps[-1] == {"bad": 4}  # b was aborted: skipped; late waits for isolation to end
    trace = run_faulty(sched, poison)
    assert "late" in trace.outputs and len(trace.outputs["late"]) == 2
    assert_all_free(sched)


def test_prefix_cache_forgets_blocks_of_the_failed_step():
    sched = make_scheduler(block_size=4, enable_caching=True, max_num_batched_tokens=64)
    shared = list(range(500, 516))
    sched.add_request(make_req("a", shared, max_tokens=2))
    sched.add_request(make_req("bad", shared + [1, 2], max_tokens=2))
    trace = Trace()
    faulty_step(sched, trace, lambda r: r.request_id == "bad")
    # The blocks hashed when allocated were never written: nothing may hit them.
    assert sched.kv_cache_manager.block_pool.cached_block_hash_to_block == {}
    sched.add_request(make_req("late", shared + [3], max_tokens=1))
    trace = run_faulty(sched, lambda r: r.request_id == "bad")
    assert trace.finish == {"a": "length", "bad": "error", "late": "length"}
    assert_all_free(sched)


def test_resumed_suspect_keeps_its_output_tokens():
    sched = make_scheduler(max_num_batched_tokens=64)
    add(sched, [("a", 4, 6), ("bad", 4, 6)])
    trace = Trace()
    for _ in range(3):  # a and bad decode together for a while
        faulty_step(sched, trace, lambda r: False)
    assert len(sched.requests["a"].output_token_ids) == 3
    trace = run_faulty(sched, lambda r: r.request_id == "bad")
    assert len(trace.outputs["a"]) == 3  # the 3 it had plus 3 more after recomputing its 7 tokens
    assert sched.num_preemptions == 0
    assert_all_free(sched)
    assert TOKEN not in trace.outputs["a"]

"""LoRA in the scheduler: at most max_loras distinct adapters among the running requests, a request whose
adapter has no slot stepping aside (skipped_waiting) for the ones behind it, under FCFS and priority; its
adapter in NewRequestData; the stats of vLLM's lora_requests_info; no KV block leaked."""

from __future__ import annotations

from typing import Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.sched.test_scheduler import Trace, assert_all_free, make_req, step
from vlite.config import LoRAConfig, SchedulerConfig
from vlite.core.kv_cache_manager import KVCacheManager
from vlite.core.sched.scheduler import Scheduler
from vlite.lora.request import LoRARequest
from vlite.request import Request

ADAPTERS = {i: LoRARequest(f"lora{i}", i, f"/adapters/lora{i}") for i in range(1, 6)}


def lora_scheduler(max_loras: Optional[int] = 1, num_blocks: int = 100, block_size: int = 4,
                   **config) -> Scheduler:
    config.setdefault("max_model_len", 1000)
    lora_config = LoRAConfig(max_loras=max_loras) if max_loras is not None else None
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size), lora_config=lora_config)


def lreq(rid: str, prompt, lora: Optional[int], **kw) -> Request:
    req = make_req(rid, prompt, **kw)
    req.lora_request = ADAPTERS[lora] if lora is not None else None
    return req


def running_adapters(sched: Scheduler) -> set[int]:
    return {r.lora_request.lora_int_id for r in sched.running if r.lora_request is not None}


def run_checked(sched: Scheduler, max_steps: int = 300) -> Trace:
    """Run to the end, checking after every schedule that the running requests hold at most max_loras adapters
    and that the runner is never handed more in one step."""
    trace = Trace()
    limit = sched.lora_config.max_loras
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return trace
        step(sched, trace)
        so = trace.scheduler_outputs[-1]
        assert len(running_adapters(sched)) <= limit
        in_step = {sched.requests[r].lora_request.lora_int_id for r in so.num_scheduled_tokens
                   if r in sched.requests and sched.requests[r].lora_request is not None}
        assert len(in_step) <= limit
    raise AssertionError(f"not finished after {max_steps} steps")


def finish_step(trace: Trace, rid: str) -> int:
    return max(trace.steps_of(rid))


def test_max_loras_one_fcfs_later_requests_go_ahead():
    sched = lora_scheduler(max_loras=1)
    for rid, lora in (("a", 1), ("b", 2), ("c", None), ("d", 1)):
        sched.add_request(lreq(rid, 5, lora, max_tokens=3))
    trace = run_checked(sched)
    # b's adapter has no slot while a's runs: the base request c and d (a's adapter) go ahead of it.
    assert trace.new[0] == ["a", "c", "d"]
    assert trace.first_step("b") == max(finish_step(trace, "a"), finish_step(trace, "d")) + 1
    assert set(trace.finish) == {"a", "b", "c", "d"}
    assert_all_free(sched)


def test_new_request_data_carries_the_adapter():
    sched = lora_scheduler(max_loras=2)
    sched.add_request(lreq("a", 5, 1))
    sched.add_request(lreq("b", 5, None))
    so = sched.schedule()
    by_id = {d.req_id: d.lora_request for d in so.scheduled_new_reqs}
    assert by_id == {"a": ADAPTERS[1], "b": None}
    assert by_id["a"].lora_int_id == 1 and by_id["a"].lora_path == "/adapters/lora1"


def test_skipped_requests_keep_their_order():
    sched = lora_scheduler(max_loras=1)
    for rid, lora, n in (("a", 1, 3), ("b", 2, 3), ("c", 3, 3), ("d", None, 3), ("e", 2, 3)):
        sched.add_request(lreq(rid, 5, lora, max_tokens=n))
    trace = run_checked(sched)
    assert trace.new[0] == ["a", "d"]
    # a's slot frees: b (first skipped) takes it, c still has none, e shares b's adapter.
    after_a = finish_step(trace, "a") + 1
    assert trace.new[after_a] == ["b", "e"]
    assert trace.first_step("c") == max(finish_step(trace, "b"), finish_step(trace, "e")) + 1
    assert_all_free(sched)


def test_two_slots():
    sched = lora_scheduler(max_loras=2)
    for rid, lora in (("a", 1), ("b", 2), ("c", 3), ("d", 2), ("e", None)):
        sched.add_request(lreq(rid, 5, lora, max_tokens=3))
    trace = run_checked(sched)
    assert trace.new[0] == ["a", "b", "d", "e"]
    assert trace.first_step("c") > trace.first_step("a")
    assert_all_free(sched)


def test_priority_policy_skips_and_resumes():
    sched = lora_scheduler(max_loras=1, policy="priority")
    sched.add_request(lreq("a", 5, 1, priority=0, max_tokens=4))
    sched.add_request(lreq("b", 5, 2, priority=1, max_tokens=2))
    sched.add_request(lreq("c", 5, None, priority=5, max_tokens=2))
    sched.add_request(lreq("d", 5, 3, priority=2, max_tokens=2))
    trace = run_checked(sched)
    # The later, lower-priority base request c goes ahead of the adapters without a slot.
    assert trace.new[0] == ["a", "c"]
    # b (better priority than d) takes the slot as soon as a's frees, d after b.
    assert trace.first_step("b") == finish_step(trace, "a") + 1
    assert trace.first_step("d") == finish_step(trace, "b") + 1
    assert_all_free(sched)


def test_priority_arrival_of_a_better_request_for_a_full_slot():
    sched = lora_scheduler(max_loras=1, policy="priority")
    sched.add_request(lreq("a", 5, 1, priority=3, max_tokens=3))
    trace = Trace()
    step(sched, trace)
    sched.add_request(lreq("b", 5, 2, priority=0, max_tokens=2))  # better priority, but no slot: no preemption
    sched.add_request(lreq("c", 5, 1, priority=9, max_tokens=2))  # a's adapter: runs at once
    step(sched, trace)
    assert trace.new[1] == ["c"]
    run_checked(sched)
    assert_all_free(sched)


def test_preemption_with_adapters_resumes_under_its_adapter():
    # 12 blocks of 4 tokens: three requests of 8 prompt tokens growing to 8 + 12 cannot all keep running.
    sched = lora_scheduler(max_loras=2, num_blocks=12, max_num_seqs=3)
    for rid, lora in (("a", 1), ("b", 2), ("c", 1)):
        sched.add_request(lreq(rid, 8, lora, max_tokens=12))
    trace = run_checked(sched)
    assert any(trace.preempted), "the test needs a preemption"
    preempted = set().union(*trace.preempted)
    for so in trace.scheduler_outputs:
        for d in so.scheduled_new_reqs:
            if d.req_id in preempted and d.num_computed_tokens == 0 and d.output_token_ids:
                assert d.lora_request == ADAPTERS[{"a": 1, "b": 2, "c": 1}[d.req_id]]
    assert set(trace.finish) == {"a", "b", "c"} and all(f == "length" for f in trace.finish.values())
    assert_all_free(sched)


def test_without_lora_config_no_limit():
    sched = lora_scheduler(max_loras=None)
    for rid, lora in (("a", 1), ("b", 2), ("c", 3)):
        sched.add_request(lreq(rid, 5, lora, max_tokens=2))
    so = sched.schedule()
    assert [d.req_id for d in so.scheduled_new_reqs] == ["a", "b", "c"]
    stats = sched.make_stats()
    assert stats.max_lora == 0 and stats.running_lora_adapters == {} and stats.waiting_lora_adapters == {}


def test_stats_count_running_and_waiting_adapters():
    sched = lora_scheduler(max_loras=1)
    for rid, lora in (("a", 1), ("b", 2), ("c", None), ("d", 1), ("e", 2)):
        sched.add_request(lreq(rid, 5, lora, max_tokens=3))
    stats = sched.make_stats()
    assert stats.max_lora == 1 and stats.running_lora_adapters == {}
    assert stats.waiting_lora_adapters == {"lora1": 2, "lora2": 2}
    step(sched, Trace())
    stats = sched.make_stats()
    assert stats.running_lora_adapters == {"lora1": 2}
    assert stats.waiting_lora_adapters == {"lora2": 2}  # in skipped_waiting
    assert stats.num_running_reqs == 3 and stats.num_waiting_reqs == 2


@settings(max_examples=40, deadline=None)
@given(max_loras=st.integers(1, 3), policy=st.sampled_from(["fcfs", "priority"]), num_blocks=st.integers(8, 40),
       reqs=st.lists(st.tuples(st.sampled_from([None, 1, 2, 3, 4]), st.integers(1, 12), st.integers(1, 6),
                               st.integers(0, 3)), min_size=1, max_size=12))
def test_adapter_limit_invariant(max_loras, policy, num_blocks, reqs):
    """Whatever arrives: never more than max_loras adapters running, every request finishes, no block leaks."""
    sched = lora_scheduler(max_loras=max_loras, num_blocks=num_blocks, policy=policy, max_num_seqs=4,
                           max_num_batched_tokens=16)
    for i, (lora, prompt_len, max_tokens, prio) in enumerate(reqs):
        sched.add_request(lreq(f"r{i}", prompt_len, lora, max_tokens=max_tokens, priority=prio))
    trace = run_checked(sched, max_steps=1000)
    assert set(trace.finish) == {f"r{i}" for i in range(len(reqs))}
    assert all(f == "length" for f in trace.finish.values())
    assert_all_free(sched)

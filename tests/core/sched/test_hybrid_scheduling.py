"""Scheduling a recurrent-state (hybrid) model: a prompt's first step stops at its last block boundary, where the
prefix cache saves the state (vLLM's "align" mode); that stop must not hold back the prompts behind it.

block_size 4; the fake model runner samples token 7 for each request that reaches the end of its tokens.
"""

from __future__ import annotations

from vlite.config import SchedulerConfig
from vlite.core.kv_cache_manager import KVCacheManager
from vlite.core.sched.output import ModelRunnerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.request import Request
from vlite.sampling_params import SamplingParams

BS = 4


def make_scheduler(max_num_batched_tokens: int, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(100, BS, caching, num_state_slots=8, num_cached_state_slots=4, group_windows=(0,))
    return Scheduler(SchedulerConfig(max_model_len=256, max_num_batched_tokens=max_num_batched_tokens), kv)


def add(sched: Scheduler, rid: str, n: int) -> None:
    base = 1000 * (ord(rid) - 96)
    sched.add_request(Request(request_id=rid, prompt_token_ids=list(range(base, base + n)),
                              sampling_params=SamplingParams(max_tokens=2)))


def step(sched: Scheduler) -> dict[str, int]:
    so = sched.schedule()
    sampled = [r for r in so.num_scheduled_tokens if r in so.sample_req_ids]
    sched.update_from_output(so, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[[7] for _ in sampled]))
    return dict(so.num_scheduled_tokens)


def test_prompts_stopping_at_the_state_boundary_start_in_one_step():
    sched = make_scheduler(64)
    for rid in "abc":
        add(sched, rid, 10)
    assert step(sched) == {"a": 8, "b": 8, "c": 8}  # each stops at 8, the state saved there
    assert step(sched) == {"a": 2, "b": 2, "c": 2}  # the last block, sampling
    assert step(sched) == {"a": 1, "b": 1, "c": 1}


def test_a_budget_cut_still_counts_as_the_one_partial_prefill():
    sched = make_scheduler(12)
    for rid in "abc":
        add(sched, rid, 10)
    # a stops at its boundary (8); b gets the 4 tokens left and is mid-prompt: c waits (max_num_partial_prefills 1)
    assert step(sched) == {"a": 8, "b": 4}
    assert step(sched) == {"a": 2, "b": 4, "c": 6}  # b reaches its boundary, c starts mid-prompt


def test_without_prefix_caching_prompts_run_whole():
    sched = make_scheduler(64, caching=False)
    for rid in "ab":
        add(sched, rid, 10)
    assert step(sched) == {"a": 10, "b": 10}

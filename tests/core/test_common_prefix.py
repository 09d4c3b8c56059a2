"""SchedulerOutput.num_common_prefix_blocks (cascade attention's shared prefix), from
KVCacheManager.get_num_common_prefix_blocks: the leading blocks every running request references.

block_size 4; a fake model runner samples one token per request that reaches the end of its tokens.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.config import SchedulerConfig
from vlite.core.kv_cache_manager import EncoderOnlyKVCacheManager, KVCacheManager
from vlite.core.kv_cache_utils import NULL_BLOCK
from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.request import Request, RequestStatus
from vlite.sampling_params import SamplingParams

BS = 4
P = list(range(100, 108))  # two full blocks every sharing request starts with


def make_req(rid: str, prompt: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(max_tokens=max_tokens),
                   arrival_time=float(len(rid) * 1000 + sum(map(ord, rid))))


def make_scheduler(num_blocks: int = 100, kv: KVCacheManager | None = None, **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    config.setdefault("max_num_batched_tokens", 64)
    return Scheduler(SchedulerConfig(**config), kv or KVCacheManager(num_blocks, BS))


def step(sched: Scheduler, token: int = 7, check=None) -> SchedulerOutput:
    """One engine step; `check(so)` runs between schedule and update (before requests finish)."""
    so = sched.schedule()
    if check is not None:
        check(so)
    rids = [r for r in so.num_scheduled_tokens if r in so.sample_req_ids]
    sched.update_from_output(so, ModelRunnerOutput(req_ids=rids, sampled_token_ids=[[token] for _ in rids]))
    return so


def block_lists(sched: Scheduler) -> list[list]:
    return [sched.kv_cache_manager.req_to_blocks[r.request_id] for r in sched.running]


def test_shared_prefix_among_running_requests_is_counted():
    sched = make_scheduler()
    for i in range(3):
        sched.add_request(make_req(f"r{i}", P + [i, i, i]))  # 11 tokens: 2 shared blocks + 1 own
    so = step(sched)
    assert len(so.scheduled_new_reqs) == 3
    assert so.num_common_prefix_blocks == 2
    lists = block_lists(sched)
    assert all(bl[:2] == lists[0][:2] for bl in lists) and len({id(bl[2]) for bl in lists}) == 3
    assert step(sched).num_common_prefix_blocks == 2  # decoding keeps it


def test_partly_shared_prefix_counts_only_what_all_share():
    sched = make_scheduler()
    sched.add_request(make_req("a", P + [1, 1, 1]))
    sched.add_request(make_req("b", P[:4] + [9, 9, 9, 9, 9]))  # only the first block in common
    assert step(sched).num_common_prefix_blocks == 1


def test_one_running_request_counts_all_its_blocks():
    """As in vLLM: every block has ref_cnt 1 == the number of running requests, the partial last one too."""
    sched = make_scheduler()
    sched.add_request(make_req("a", list(range(10))))  # 3 blocks, the last half full
    so = step(sched)
    assert so.num_common_prefix_blocks == 3 == len(block_lists(sched)[0])
    nocache = make_scheduler(kv=KVCacheManager(100, BS, enable_caching=False))
    nocache.add_request(make_req("a", list(range(10))))
    assert step(nocache).num_common_prefix_blocks == 3


def test_no_caching_two_identical_prompts_share_nothing():
    sched = make_scheduler(kv=KVCacheManager(100, BS, enable_caching=False))
    sched.add_request(make_req("a", P + [1]))
    sched.add_request(make_req("b", P + [1]))
    assert step(sched).num_common_prefix_blocks == 0


def test_joining_request_that_shares_nothing_gives_zero_until_it_finishes():
    sched = make_scheduler()
    sched.add_request(make_req("a", P + [1, 1, 1]))
    sched.add_request(make_req("b", P + [2, 2, 2]))
    assert step(sched).num_common_prefix_blocks == 2
    sched.add_request(make_req("c", [50, 51, 52, 53, 54], max_tokens=2))
    so = step(sched)
    assert [d.req_id for d in so.scheduled_new_reqs] == ["c"]
    assert so.num_common_prefix_blocks == 0
    so = step(sched)  # c samples its second and last token and finishes: its blocks go back
    assert so.num_common_prefix_blocks == 0 and sched.requests.get("c") is None
    so = step(sched)
    assert "c" in so.finished_req_ids and so.num_common_prefix_blocks == 2


def test_finished_request_releases_its_references():
    """A prefix still in the prefix cache after a request ends is not counted with that request: its
    ref_cnt drops with it, and the remaining running requests match the new count."""
    sched = make_scheduler()
    sched.add_request(make_req("a", P + [1, 1, 1], max_tokens=1))
    sched.add_request(make_req("b", P + [2, 2, 2]))
    sched.add_request(make_req("c", P[:4] + [3, 3, 3, 3, 3]))
    assert step(sched).num_common_prefix_blocks == 1  # a finishes here (max_tokens 1)
    assert step(sched).num_common_prefix_blocks == 1  # b and c share block 0 only
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert step(sched).num_common_prefix_blocks == 4  # b alone: all of its blocks


def test_request_preempted_this_step_is_not_counted():
    """a and b share two blocks, c shares none; the pool runs dry when they decode into a 4th block and c
    (the last) is preempted in the same step: the count is over a and b only."""
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_req("a", P + [1, 1, 1, 1]))  # 12 tokens: 3 full blocks
    sched.add_request(make_req("b", P + [2, 2, 2, 2]))
    sched.add_request(make_req("c", list(range(60, 72))))
    assert step(sched).num_common_prefix_blocks == 0  # 7 of 8 blocks taken
    so = step(sched)
    assert so.preempted_req_ids == {"c"}
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert so.num_common_prefix_blocks == 2


def test_sliding_window_gives_zero():
    """As vLLM's SlidingWindowManager: the leading blocks become NULL_BLOCK as they leave the window."""
    kv = KVCacheManager(100, BS, sliding_window=6)
    sched = make_scheduler(kv=kv)
    sched.add_request(make_req("a", P + [1, 1, 1]))
    sched.add_request(make_req("b", P + [2, 2, 2]))
    so = step(sched)
    lists = block_lists(sched)
    assert lists[0][1] is lists[1][1] and lists[0][1] is not NULL_BLOCK  # a shared block, yet:
    assert so.num_common_prefix_blocks == 0
    for _ in range(4):
        assert step(sched).num_common_prefix_blocks == 0
    assert block_lists(sched)[0][0] is NULL_BLOCK
    assert kv.get_num_common_prefix_blocks(sched.running[0], len(sched.running)) == 0


def test_encoder_only_manager_gives_zero():
    kv = EncoderOnlyKVCacheManager(BS)
    sched = make_scheduler(kv=kv, max_num_batched_tokens=256, enable_chunked_prefill=False)
    sched.add_request(make_req("a", P + [1], max_tokens=1))
    sched.add_request(make_req("b", P + [1], max_tokens=1))
    so = sched.schedule()
    assert len(sched.running) == 2 and so.num_common_prefix_blocks == 0
    assert kv.get_num_common_prefix_blocks(sched.running[0], 2) == 0


def test_no_running_request_gives_zero():
    sched = make_scheduler()
    assert sched.schedule().num_common_prefix_blocks == 0


PREFIXES = ([], P[:4], P, P + [0, 1, 2, 3])


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(6, 40), budget=st.integers(4, 48),
       window=st.sampled_from([None, None, 5]), ops=st.lists(st.sampled_from("aaassx"), min_size=4, max_size=40))
def test_count_is_the_common_block_prefix_of_every_running_request(seed, num_blocks, budget, window, ops):
    """Against the definition: after every schedule, the counted blocks stand at the same indices in every
    running request's list, the count never exceeds any list, and (full attention) it is the longest such
    run, ending early only when a running request does not share the next block."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, BS, sliding_window=window)
    sched = make_scheduler(kv=kv, max_num_batched_tokens=budget, max_num_seqs=6)
    n = 0
    for op in ops:
        if op == "a":
            prompt = rng.choice(PREFIXES) + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            sched.add_request(make_req(f"r{n}", prompt, max_tokens=rng.randrange(1, 8)))
            n += 1
        elif op == "x" and sched.running:
            sched.finish_requests([rng.choice(sched.running).request_id], RequestStatus.FINISHED_ABORTED)
        else:
            def check(so: SchedulerOutput) -> None:
                assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}  # only they hold blocks
                count, lists = so.num_common_prefix_blocks, block_lists(sched)
                if not lists or window is not None:
                    assert count == 0
                    return
                assert all(count <= len(bl) for bl in lists)
                assert all(bl[i] is lists[0][i] and bl[i] is not NULL_BLOCK for bl in lists for i in range(count))
                longest = 0
                while all(longest < len(bl) and bl[longest] is lists[0][longest] for bl in lists):
                    longest += 1
                assert count == longest
            step(sched, token=rng.randrange(3), check=check)

"""Scheduler with speculative decoding, on a fake runner (no torch): drafts are scheduled after the
next token within the budget, rejected ones roll back num_computed_tokens and free the blocks only
they held, prefix-cache hashes cover verified tokens only, and preemption/max_tokens/stops behave."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.config import SchedulerConfig, SpeculativeConfig
from vlite.core.kv_cache_manager import KVCacheManager
from vlite.core.kv_cache_utils import compute_block_hashes
from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.request import Request, RequestStatus
from vlite.sampling_params import SamplingParams

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)


def make(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    config.setdefault("max_model_len", 200)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size, True), SPEC)


def req(rid: str, prompt: list[int], **sp) -> Request:
    sp.setdefault("max_tokens", 20)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(**sp))


def run_step(s: Scheduler, accept: dict[str, int], drafts: dict[str, list[int]], token: int = 5
             ) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """One step: each sampled request keeps `accept[rid]` of its scheduled drafts plus `token`, and
    proposes `drafts[rid]` for the next step."""
    so = s.schedule()
    req_ids = sorted(so.sample_req_ids)
    sampled = []
    for rid in req_ids:
        spec = so.scheduled_spec_decode_tokens.get(rid, [])
        n = min(accept.get(rid, 0), len(spec))
        sampled.append(spec[:n] + [token])
    out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                            spec_token_ids={r: d for r, d in drafts.items() if r in req_ids})
    s.update_from_output(so, out)
    return so, out


def test_drafts_scheduled_with_next_token_and_rolled_back():
    s = make()
    r = req("a", [1, 2, 3, 4, 5, 6])
    s.add_request(r)
    so, _ = run_step(s, {}, {"a": [9, 9, 9]})  # prefill: 6 tokens, 1 sampled, 3 drafts proposed
    assert so.num_scheduled_tokens == {"a": 6} and not so.scheduled_spec_decode_tokens
    assert r.num_tokens == 7 and r.num_computed_tokens == 6 and r.spec_token_ids == [9, 9, 9]

    so, _ = run_step(s, {"a": 1}, {"a": [8, 8]})  # verify 1 + 3: keep 1 draft + 1 token
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [9, 9, 9]}
    assert r.output_token_ids == [5, 9, 5]
    # 6 + 4 computed, 2 drafts rejected: the K/V of positions 8 and 9 are not the request's
    assert r.num_computed_tokens == 8 and r.num_tokens == 9
    assert r.spec_token_ids == [8, 8]

    so, _ = run_step(s, {"a": 2}, {})
    assert so.num_scheduled_tokens == {"a": 3}
    assert r.output_token_ids == [5, 9, 5, 8, 8, 5]
    assert r.num_computed_tokens == r.num_tokens - 1 == 11
    assert r.spec_token_ids == []
    so, _ = run_step(s, {}, {})
    assert so.num_scheduled_tokens == {"a": 1}


def test_blocks_only_rejected_drafts_held_are_freed_and_runner_told():
    s = make(block_size=4)
    r = req("a", [1, 2, 3])
    s.add_request(r)
    run_step(s, {}, {"a": [9, 9, 9]})  # 4 tokens known, drafts reach position 6
    kv = s.kv_cache_manager
    free_before = kv.get_num_free_blocks()
    so, _ = run_step(s, {"a": 0}, {})  # all rejected, no new drafts: tokens 0..4 need 2 blocks
    assert so.scheduled_cached_reqs.num_blocks_before == [1]
    assert len(so.scheduled_cached_reqs.new_block_ids[0][0]) == 1  # the verify step took a second block
    assert r.num_tokens == 5 and kv.get_num_blocks("a") == 2
    assert kv.get_num_free_blocks() == free_before - 1
    # Drafts that cross into a third block: it is taken, then freed when they are all rejected.
    r.spec_token_ids = [7, 7, 7, 7]
    so, _ = run_step(s, {"a": 0}, {})
    assert kv.get_num_blocks("a") == 2  # 6 tokens
    so, _ = run_step(s, {}, {})
    assert so.scheduled_cached_reqs.num_blocks_before == [2]


def test_prefix_hashes_cover_verified_tokens_only():
    s = make(block_size=4)
    r = req("a", [1, 2, 3])
    s.add_request(r)
    run_step(s, {}, {"a": [11, 12, 13]})
    run_step(s, {"a": 0}, {})  # drafts 11.. rejected; tokens are 1 2 3 5 5
    pool = s.kv_cache_manager.block_pool
    full = compute_block_hashes(r.all_token_ids, 4, [])
    assert pool.get_cached_block(full[0]) is not None
    wrong = compute_block_hashes([1, 2, 3, 5, 11, 12, 13, 0], 4, [])
    assert pool.get_cached_block(wrong[1]) is None


def test_drafts_cut_to_budget_and_to_max_tokens():
    s = make(max_num_batched_tokens=3)
    r = req("a", [1, 2], max_tokens=4)
    s.add_request(r)
    run_step(s, {}, {"a": [9, 9, 9]})
    so, _ = run_step(s, {"a": 3}, {})
    # budget 3 = next token + 2 drafts
    assert so.scheduled_spec_decode_tokens == {"a": [9, 9]}
    assert r.output_token_ids == [5, 9, 9, 5] and r.status == RequestStatus.FINISHED_LENGTH_CAPPED

    s = make()
    r = req("b", [1, 2], max_tokens=3)
    s.add_request(r)
    run_step(s, {}, {"b": [9, 9, 9]})
    # 1 output so far, max 3: the next step can add 2 tokens, so 1 draft at most
    assert r.spec_token_ids == [9]


def test_stop_token_inside_accepted_drafts_ends_request():
    s = make()
    r = req("a", [1, 2], stop_token_ids=[42])
    s.add_request(r)
    run_step(s, {}, {"a": [3, 42, 4]})
    run_step(s, {"a": 3}, {})
    assert r.output_token_ids == [5, 3, 42]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert "a" not in s.requests and s.kv_cache_manager.get_num_free_blocks() == 64


def test_preemption_drops_drafts():
    s = make(num_blocks=4, block_size=4)
    a, b = req("a", [1, 2, 3, 4, 5, 6, 7]), req("b", [8, 9, 10, 11, 12, 13, 14])
    s.add_request(a)
    s.add_request(b)
    run_step(s, {}, {"a": [1, 1, 1], "b": [2, 2, 2]})  # 2 blocks each: the pool is full
    so, _ = run_step(s, {"a": 3}, {})
    assert "b" in so.preempted_req_ids and b.spec_token_ids == [] and b.status == RequestStatus.PREEMPTED
    assert so.scheduled_spec_decode_tokens == {"a": [1, 1, 1]}


def test_stats_count_drafts_and_accepted_per_position():
    s = make()
    r = req("a", [1, 2])
    s.add_request(r)
    run_step(s, {}, {"a": [9, 9, 9]})
    run_step(s, {"a": 2}, {"a": [9, 9]})
    run_step(s, {"a": 0}, {})
    st = s.make_stats().spec_decoding
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (2, 5, 2)
    assert st.num_accepted_tokens_per_pos == [1, 1, 0]
    assert st.mean_acceptance_length == 2.0


def test_abort_with_scheduled_drafts_frees_everything():
    s = make()
    r = req("a", [1, 2, 3, 4, 5])
    s.add_request(r)
    run_step(s, {}, {"a": [9, 9, 9]})
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [9, 9, 9]}
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    s.update_from_output(so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[9, 5]]))
    assert s.kv_cache_manager.get_num_free_blocks() == 64 and not s.requests


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1), st.integers(8, 40))
def test_invariants_under_random_acceptance(reqs, seed, num_blocks):
    """Random prompts, draft proposals and acceptance, a small pool (preemption): every step keeps
    num_computed_tokens < num_tokens_with_spec + 1, blocks cover the computed tokens, outputs reach
    max_tokens exactly, and every block is free at the end."""
    rng = random.Random(seed)
    s = make(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=24)
    requests = []
    for i, (plen, max_tokens) in enumerate(reqs):
        if plen + max_tokens > num_blocks * 4:
            continue
        r = req(f"r{i}", [rng.randrange(50) for _ in range(plen)], max_tokens=max_tokens)
        requests.append(r)
        s.add_request(r)
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for rid, n in so.num_scheduled_tokens.items():
            r = s.requests[rid]
            assert r.num_computed_tokens <= r.num_tokens + len(so.scheduled_spec_decode_tokens.get(rid, []))
            assert len(s.kv_cache_manager.req_to_blocks[rid]) * 4 >= r.num_computed_tokens
        req_ids = sorted(so.sample_req_ids)
        sampled = []
        for rid in req_ids:
            spec = so.scheduled_spec_decode_tokens.get(rid, [])
            sampled.append(spec[:rng.randint(0, len(spec))] + [rng.randrange(50)])
        drafts = {rid: [rng.randrange(50) for _ in range(rng.randint(0, 3))] for rid in req_ids}
        s.update_from_output(so, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                                   spec_token_ids=drafts))
        for r in s.running:
            assert r.num_computed_tokens <= r.num_tokens
    assert not s.has_unfinished_requests()
    for r in requests:
        assert len(r.output_token_ids) == r.sampling_params.max_tokens
    assert s.kv_cache_manager.get_num_free_blocks() == num_blocks

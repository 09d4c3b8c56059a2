"""Pooling requests in the scheduler (no torch): an encoder's prompt runs whole in one step or waits, without
holding up the shorter prompts behind it; a request ends with its pooled output ("pooling finished"), keeping
no KV block."""

from __future__ import annotations

from vlite.config import SchedulerConfig
from vlite.core.kv_cache_manager import EncoderOnlyKVCacheManager
from vlite.core.sched.output import ModelRunnerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.pooling_params import PoolingParams
from vlite.request import Request
from vlite.sampling_params import SamplingParams


def _pooling_request(rid: str, n: int, arrival: float) -> Request:
    params = SamplingParams(detokenize=False)  # the Request takes max_tokens 0 from its pooling_params
    return Request(rid, list(range(5, 5 + n)), params, arrival_time=arrival, pooling_params=PoolingParams(task="embed"))


def test_unchunked_prompts_run_whole_and_finish_with_their_pooled_output():
    config = SchedulerConfig(max_num_batched_tokens=10, max_model_len=10, enable_chunked_prefill=False)
    sched = Scheduler(config, EncoderOnlyKVCacheManager(block_size=4))
    for i, n in enumerate([6, 6, 3, 10]):
        sched.add_request(_pooling_request(f"r{i}", n, float(i)))
    trace = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        trace.append(dict(so.num_scheduled_tokens))
        assert so.sample_req_ids == set() and so.prompt_done_req_ids == set(so.num_scheduled_tokens)
        pooled = {r: [float(n)] for r, n in so.num_scheduled_tokens.items()}
        outs = sched.update_from_output(so, ModelRunnerOutput([], [], pooler_output=pooled))
        for out in outs:
            assert out.finish_reason == "stop" and out.pooling_output == pooled[out.request_id]
    # r1 (6) does not fit beside r0: r2 (3) goes past it; r1 keeps its place; r3 (10) needs a step alone
    assert trace == [{"r0": 6, "r2": 3}, {"r1": 6}, {"r3": 10}]
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.kv_cache_manager.num_blocks

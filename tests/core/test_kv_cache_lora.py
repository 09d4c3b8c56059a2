"""Prefix caching under LoRA: a request's block hashes include its adapter (name, id, path), so K/V computed
under one adapter, or the base model, are never served to another; the base model's hashes are unchanged."""

from __future__ import annotations

from tests.core.sched.test_scheduler import Trace, assert_all_free, make_req, step
from vlite.config import LoRAConfig, SchedulerConfig
from vlite.core.kv_cache_manager import KVCacheManager
from vlite.core.kv_cache_utils import compute_block_hashes, lora_extra_keys
from vlite.core.sched.scheduler import Scheduler
from vlite.lora.request import LoRARequest

L1 = LoRARequest("one", 1, "/adapters/one")
L2 = LoRARequest("two", 2, "/adapters/two")
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks of 4


def test_extra_keys():
    assert lora_extra_keys(None) == b""
    keys = {lora_extra_keys(x) for x in (L1, L2, LoRARequest("one", 1, "/elsewhere"), LoRARequest("one", 3, "/a"),
                                         LoRARequest("on", 1, "e/adapters/one"))}
    assert len(keys) == 5 and b"" not in keys


def _hashes(lora):
    req = make_req("x", PROMPT)
    req.lora_request = lora
    kv = KVCacheManager(10, 4)
    return kv._block_hashes(req)


def test_block_hashes_depend_on_the_adapter():
    base, one, two = _hashes(None), _hashes(L1), _hashes(L2)
    assert base == compute_block_hashes(PROMPT, 4, [])  # unchanged without an adapter
    assert len(base) == len(one) == len(two) == 3
    assert not set(base) & set(one) and not set(one) & set(two) and not set(base) & set(two)
    assert _hashes(LoRARequest("one", 1, "/adapters/one")) == one


def test_prefix_hits_only_under_the_same_adapter():
    sched = Scheduler(SchedulerConfig(max_model_len=100), KVCacheManager(40, 4), lora_config=LoRAConfig(max_loras=2))
    trace = Trace()
    first = make_req("first", PROMPT, max_tokens=1)
    first.lora_request = L1
    sched.add_request(first)
    step(sched, trace)  # finishes; its blocks stay cached
    cached = {}
    for rid, lora in (("same", L1), ("other", L2), ("base", None)):
        req = make_req(rid, PROMPT, max_tokens=1)
        req.lora_request = lora
        sched.add_request(req)
        step(sched, trace)
        cached[rid] = req.num_cached_tokens
    assert cached == {"same": 12, "other": 0, "base": 0}
    again = make_req("base2", PROMPT, max_tokens=1)  # the base model's own blocks are served to the base model
    sched.add_request(again)
    step(sched, trace)
    assert again.num_cached_tokens == 12
    assert_all_free(sched)

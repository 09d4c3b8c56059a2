"""The scheduler with a KV connector (the OffloadingConnector's scheduler side over a fake store, no torch):
requests whose prefix is in the store wait in WAITING_FOR_REMOTE_KVS without holding up the others, keep
their place under FCFS and priority once loaded, recompute what failed to load, and never leak blocks."""

from __future__ import annotations

from typing import Optional

from vlite.config import SchedulerConfig
from vlite.core.kv_cache_manager import KVCacheManager
from vlite.core.kv_cache_utils import compute_block_hashes
from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.kv_connector.base import KVConnectorOutput, KVConnectorRole
from vlite.kv_connector.offloading_connector import OffloadingConnector
from vlite.request import Request, RequestStatus
from vlite.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 40


class FakeStore:
    def __init__(self) -> None:
        self.hashes: set[bytes] = set()

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes

    def put_prompt(self, prompt: list[int], num_blocks: int) -> None:
        self.hashes.update(compute_block_hashes(prompt, BS, [])[:num_blocks])


def make(policy: str = "fcfs", **config) -> tuple[Scheduler, FakeStore]:
    store = FakeStore()
    connector = OffloadingConnector(KVConnectorRole.SCHEDULER, [store], BS)  # type: ignore[list-item]
    sched = Scheduler(SchedulerConfig(max_model_len=200, policy=policy, **config), KVCacheManager(NUM_BLOCKS, BS),
                      kv_connector=connector)
    return sched, store


def prompt(base: int, n: int = 14) -> list[int]:
    return list(range(base, base + n))


def req(rid: str, tokens: list[int], arrival: float, priority: int = 0, prompt_logprobs: Optional[int] = None
        ) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=2, prompt_logprobs=prompt_logprobs), arrival_time=arrival,
                   priority=priority)


def step(sched: Scheduler, loaded: Optional[dict[str, int]] = None) -> SchedulerOutput:
    out = sched.schedule()
    ids = sorted(out.sample_req_ids)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids],
                                                    kv_connector_output=KVConnectorOutput(loaded or {})))
    return out


def new_ids(out: SchedulerOutput) -> list[str]:
    return [n.req_id for n in out.scheduled_new_reqs]


def test_loading_request_waits_without_blocking_and_keeps_its_fcfs_place() -> None:
    sched, store = make()
    a, c = req("a", prompt(100), 1.0), req("c", prompt(200), 2.0)
    store.put_prompt(a.prompt_token_ids, 3)
    sched.add_request(a)
    sched.add_request(c)
    out = step(sched)
    assert new_ids(out) == ["c"] and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert a in sched.skipped_waiting and sched.kv_cache_manager.get_num_blocks("a") == 3
    meta = out.kv_connector_metadata
    assert meta is not None and [t[1] for t in meta.loads["a"]] == sched.kv_cache_manager.get_block_ids("a")
    out = step(sched, loaded={"a": 3})  # the worker reports the load done with this step's output
    assert new_ids(out) == [] and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.kv_connector_metadata is not None and not out.kv_connector_metadata.loads  # asked once only
    sched.add_request(req("d", prompt(300), 3.0))
    out = step(sched)
    assert new_ids(out) == ["a", "d"]  # a arrived before d: it goes first once loaded
    new_a = out.scheduled_new_reqs[0]
    assert new_a.num_computed_tokens == 12 and out.num_scheduled_tokens["a"] == 2  # only the last 2 tokens
    assert a.num_cached_tokens == 12
    stats = sched.make_stats()
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (14 * 3, 12)


def test_priority_order_after_the_load() -> None:
    sched, store = make("priority")
    a = req("a", prompt(100), 1.0, priority=1)
    store.put_prompt(a.prompt_token_ids, 3)
    sched.add_request(a)
    assert new_ids(step(sched)) == [] and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, loaded={"a": 3})
    sched.add_request(req("b", prompt(200), 2.0, priority=0))
    sched.add_request(req("c", prompt(300), 3.0, priority=2))
    assert new_ids(step(sched)) == ["b", "a", "c"]  # (priority, arrival), a from skipped_waiting


def test_failed_blocks_are_recomputed_and_not_asked_again() -> None:
    sched, store = make()
    a = req("a", prompt(100), 1.0)
    store.put_prompt(a.prompt_token_ids, 3)
    sched.add_request(a)
    step(sched, loaded={"a": 1})  # the second block's file was damaged
    out = step(sched)
    assert new_ids(out) == ["a"] and out.scheduled_new_reqs[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens["a"] == 10 and not out.kv_connector_metadata.loads
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS


def test_abort_while_loading_frees_the_blocks_once_the_load_is_done() -> None:
    sched, store = make()
    a = req("a", prompt(100), 1.0)
    store.put_prompt(a.prompt_token_ids, 3)
    sched.add_request(a)
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and a not in sched.skipped_waiting
    assert sched.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS - 3  # the worker may still write them
    sched.add_request(req("b", prompt(200), 2.0))
    step(sched, loaded={"a": 3})
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS


def test_saves_each_newly_computed_full_block_once() -> None:
    sched, _ = make(max_num_batched_tokens=6)
    sched.add_request(req("a", prompt(100, 10), 1.0))
    saved = []
    while sched.has_unfinished_requests():
        out = step(sched)
        saved.append([bid for _, bid in out.kv_connector_metadata.saves])
    blocks = [0, 1]  # tokens 0..5 fill block 0; 6..9 (and the first output token, 10) block 1 and 2's start
    assert saved[0] == [blocks[0]] and saved[1] == [blocks[1]] and all(not s for s in saved[2:])
    sched.add_request(req("b", prompt(100, 10), 2.0))  # the same prompt: local hits, and nothing saved again
    while sched.has_unfinished_requests():
        assert not step(sched).kv_connector_metadata.saves


def test_prompt_logprobs_and_short_prompts_skip_the_store() -> None:
    sched, store = make()
    a = req("a", prompt(100), 1.0, prompt_logprobs=1)
    b = req("b", prompt(200, 4), 2.0)  # one block, holding the last token: never loaded
    store.put_prompt(a.prompt_token_ids, 3)
    store.put_prompt(b.prompt_token_ids, 1)
    sched.add_request(a)
    sched.add_request(b)
    assert new_ids(step(sched)) == ["a", "b"]


def test_step_failure_while_loading_drops_the_loaded_prefix() -> None:
    """A step raised while `a` loads: its blocks may hold K/V that step never wrote, so once the load is
    reported they are freed uncached and `a` is admitted afresh (the store asked again)."""
    sched, store = make()
    a, b = req("a", prompt(100), 1.0), req("b", prompt(200), 2.0)
    store.put_prompt(a.prompt_token_ids, 3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert new_ids(out) == ["b"] and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.handle_step_failure(out) == [b]  # b alone in the step: it failed
    assert sched.kv_cache_manager.get_num_blocks("a") == 3  # still held: the worker may be writing them
    step(sched, loaded={"a": 3})
    out = step(sched)
    assert new_ids(out) == [] and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # loading again, afresh
    step(sched, loaded={"a": 3})
    out = step(sched)
    assert new_ids(out) == ["a"] and out.scheduled_new_reqs[0].num_computed_tokens == 12
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS

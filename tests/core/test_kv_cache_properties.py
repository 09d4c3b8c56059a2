"""Stateful property tests of the KV block bookkeeping.

Two hypothesis state machines:

* `KVCacheManagerMachine` drives KVCacheManager directly, the way the scheduler would: admit a
  request (prefix-cache lookup + allocate), allocate chunks for running ones, run a "model step"
  that writes and reads a simulated KV cache, finish / preempt / abort.
* `SchedulerMachine` drives the real Scheduler with a fake model runner that keeps its own block
  tables from the SchedulerOutput deltas, as the real runner does, and samples random tokens.

The simulated KV cache stores, for every slot, the whole token prefix ending at that position
(what a real K/V vector depends on). Every read checks that a request sees exactly its own prefix
at every position it attends to, which is what makes prefix caching correct.

Both machines also run with a sliding window (every layer of the model attends to its last
`window` keys): reads then cover only the window of each query, the manager frees the blocks
behind it (NULL_BLOCK in their place), and a read of a freed block (perhaps reused by another
request) fails like any wrong K/V.

Prompts are drawn from a tiny alphabet so that prefixes (and whole blocks) collide often.
"""

from __future__ import annotations

import random
from typing import Optional

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vlite.config import SchedulerConfig
from vlite.core.kv_cache_manager import KVCacheManager, cdiv
from vlite.core.kv_cache_utils import NULL_BLOCK, hash_block_tokens
from vlite.core.sched.output import ModelRunnerOutput
from vlite.core.sched.scheduler import Scheduler
from vlite.request import Request, RequestStatus
from vlite.sampling_params import SamplingParams

ALPHABET = (0, 1, 2)
# Prompts start with one of a few shared prefixes, so that whole blocks collide often.
PREFIXES = ((), (0, 0, 0, 0, 0, 0), (0, 1, 2, 0, 1, 2, 0, 1), (1, 1, 2, 2))


def prompts(max_size: int):
    return st.builds(lambda p, s: (list(p) + s)[:max_size] or [0], st.sampled_from(PREFIXES),
                     st.lists(st.sampled_from(ALPHABET), max_size=6))

SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def chain_hashes(tokens, block_size: int) -> list:
    """Chained hashes of the full blocks of `tokens`, spelled out with hash_block_tokens."""
    out, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, list(tokens[start:start + block_size]))
        out.append(parent)
    return out


class KVModel:
    """The simulated KV cache: kv[block_id][offset] = token prefix ending at that position."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[Optional[tuple]]] = [[None] * block_size for _ in range(num_blocks)]

    def write(self, block_ids: list[int], tokens: list[int], start: int, n: int) -> None:
        bs = self.block_size
        for p in range(start, start + n):
            self.kv[block_ids[p // bs]][p % bs] = tuple(tokens[:p + 1])

    def check_read(self, block_ids: list[int], tokens: list[int], end: int, who: str, first: int = 0) -> None:
        """The request attends to positions [first, end): each must hold its own prefix."""
        bs = self.block_size
        assert len(block_ids) * bs >= end, f"{who}: {len(block_ids)} blocks cannot hold {end} tokens"
        for p in range(first, end):
            assert block_ids[p // bs] >= 0, f"{who} reads position {p} from a block freed behind its window"
            got = self.kv[block_ids[p // bs]][p % bs]
            assert got == tuple(tokens[:p + 1]), (
                f"{who} reads wrong K/V at position {p} (block {block_ids[p // bs]}): "
                f"expected prefix {tokens[:p + 1]}, found {got}")

    def check_cached_block(self, block_id: int, block_hash) -> None:
        """A registered block holds a full block whose contents chain-hash to its key."""
        bs = self.block_size
        slots = self.kv[block_id]
        assert all(s is not None for s in slots), f"cached block {block_id} is not fully written: {slots}"
        prefix = slots[-1]
        assert len(prefix) % bs == 0, f"cached block {block_id} ends at position {len(prefix)}"
        for j, s in enumerate(slots):
            assert s == prefix[:len(prefix) - bs + j + 1], f"block {block_id} slot {j} is inconsistent"
        assert chain_hashes(prefix, bs)[-1] == block_hash, f"block {block_id}: hash does not match contents"


def first_key(position: int, window: Optional[int]) -> int:
    """The first position a query at `position` attends to."""
    return 0 if window is None else max(0, position - window + 1)


def check_block_invariants(kv: KVCacheManager, live_block_lists: dict[str, list]) -> None:
    """Free queue XOR referenced; ref_cnt == number of live block lists holding the block (NULL_BLOCK,
    standing for a block freed behind a sliding window, is in no list's count and never in the pool)."""
    pool = kv.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.free_block_queue.num_free_blocks == kv.get_num_free_blocks()
    free_ids = [b.block_id for b in free]
    assert len(set(free_ids)) == len(free_ids), f"a block is twice in the free queue: {free_ids}"
    assert all(pool.blocks[i] is b for i, b in zip(free_ids, free))
    assert set(kv.req_to_blocks) == set(live_block_lists)
    counts = [0] * pool.num_blocks
    for rid, blocks in kv.req_to_blocks.items():
        assert [id(b) for b in blocks] == [id(b) for b in live_block_lists[rid]], f"{rid}: block list differs"
        live = [b for b in blocks if b is not NULL_BLOCK]
        assert len({b.block_id for b in live}) == len(live), f"{rid} holds a block twice"
        nulls = len(blocks) - len(live)
        assert all(b is NULL_BLOCK for b in blocks[:nulls]), f"{rid}: freed blocks are not a prefix: {blocks}"
        assert kv.sliding_window is not None or nulls == 0
        for b in live:
            counts[b.block_id] += 1
    free_set = set(free_ids)
    for block in pool.blocks:
        assert block.ref_cnt == counts[block.block_id], (block, counts[block.block_id])
        assert (block.ref_cnt == 0) == (block.block_id in free_set), block
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block.get(block.block_hash) is block, block
    for key, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == key
    assert NULL_BLOCK.ref_cnt == 0 and NULL_BLOCK.block_hash is None and NULL_BLOCK not in pool.blocks
    if not kv.enable_caching:
        assert not pool.cached_block_hash_to_block


def check_request_hashes(kv: KVCacheManager, req: Request) -> None:
    """Every cached block in a request's table is that request's own prefix block."""
    blocks = kv.req_to_blocks.get(req.request_id, [])
    hashes = chain_hashes(req.all_token_ids, kv.block_size)
    for i, b in enumerate(blocks):
        if b.block_hash is not None:
            assert i < len(hashes) and b.block_hash == hashes[i], f"{req.request_id} block {i} holds other tokens"


class KVCacheManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: Optional[KVCacheManager] = None
        self.reqs: dict[str, Request] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.blocks: dict[str, list] = {}  # expected block list of each running request
        self.pending: dict[str, tuple[int, int]] = {}  # rid -> (start, n) allocated, not yet computed
        self.next_id = 0
        self.rng = random.Random(0)

    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 3, 4]),
                enable_caching=st.booleans(), seed=st.integers(0, 2 ** 16),
                window=st.sampled_from([None, None, 1, 2, 3, 5]))
    def init(self, num_blocks, block_size, enable_caching, seed, window):
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching, sliding_window=window)
        self.window = window
        self.model = KVModel(num_blocks, block_size)
        self.rng = random.Random(seed)

    # ---- helpers -----------------------------------------------------------------------------

    def _snapshot(self):
        kv, pool = self.kv, self.kv.block_pool
        return ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                [(b.ref_cnt, b.block_hash) for b in pool.blocks], dict(pool.cached_block_hash_to_block),
                {k: list(v) for k, v in kv.req_to_blocks.items()}, dict(kv.num_cached_block),
                vars(kv.prefix_cache_stats).copy())

    def _skipped(self, num_computed: int) -> int:
        """Blocks wholly before the window of a query at `num_computed`: the manager frees them."""
        return first_key(num_computed, self.window) // self.kv.block_size

    def _after_allocate(self, req: Request, start: int, n: int) -> None:
        blocks = self.blocks[req.request_id]
        assert len(blocks) == cdiv(start + n, self.kv.block_size)
        self.pending[req.request_id] = (start, n)

    def _idle(self, rid: str) -> bool:
        return rid not in self.pending

    # ---- rules -------------------------------------------------------------------------------

    @rule(prompt=prompts(12),
          want_prompt_logprobs=st.integers(0, 9))
    def add_request(self, prompt, want_prompt_logprobs):
        self._add(prompt, want_prompt_logprobs == 0)

    def _add(self, prompt, prompt_logprobs: bool) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        sp = SamplingParams(prompt_logprobs=1 if prompt_logprobs else None)
        self.reqs[rid] = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp)
        self.waiting.append(rid)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def add_copy(self, data):
        """A new request whose prompt is a prefix of a live request's tokens: sure prefix hits."""
        src = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        n = data.draw(st.integers(1, src.num_tokens))
        self._add(src.all_token_ids[:n], False)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        """Prefix-cache lookup, then allocate a first chunk (a cache-hit admission when it hits)."""
        kv, bs = self.kv, self.kv.block_size
        rid = data.draw(st.sampled_from(self.waiting))
        req = self.reqs[rid]
        assert req.num_computed_tokens == 0
        hit, num_hit = kv.get_computed_blocks(req)
        assert num_hit == len(hit) * bs
        assert num_hit <= req.num_tokens - 1, "the last token must always be recomputed"
        if not kv.enable_caching or req.sampling_params.prompt_logprobs is not None:
            assert hit == []
        # The hit is the longest cached prefix, its blocks are the request's own prefix blocks.
        hashes = chain_hashes(req.all_token_ids, bs)
        expect = 0
        cached = kv.block_pool.cached_block_hash_to_block
        if kv.enable_caching and req.sampling_params.prompt_logprobs is None:
            if self.window is None:
                for hsh in hashes[:(req.num_tokens - 1) // bs]:
                    if hsh not in cached:
                        break
                    expect += 1
            else:  # the longest prefix whose blocks the first computed query reads (its last one at least) are cached
                expect = next((n for n in range((req.num_tokens - 1) // bs, 0, -1)
                               if all(h in cached for h in hashes[min(self._skipped(n * bs), n - 1):n])), 0)
        assert len(hit) == expect
        skipped = min(self._skipped(num_hit), len(hit))  # hit blocks behind the window are not taken
        assert all(b is NULL_BLOCK for b in hit[:skipped])
        for i, b in enumerate(hit[skipped:], skipped):
            assert b.block_hash == hashes[i]

        n = data.draw(st.integers(1, req.num_tokens - num_hit))
        before = self._snapshot()
        free_hits = sum(1 for b in hit if b.ref_cnt == 0 and b is not NULL_BLOCK)
        need = cdiv(num_hit + n, bs) - len(hit)
        new = kv.allocate_slots(req, n, num_hit, hit)
        if new is None:
            assert self._snapshot() == before, "a refused allocation changed state"
            assert need > kv.get_num_free_blocks() - free_hits, "refused although it fits"
            return
        assert len(new) == need
        self.blocks[rid] = list(hit) + list(new)
        for b in new:
            self.model.kv[b.block_id] = [None] * bs  # fresh block: nothing valid in it yet
        req.num_computed_tokens = num_hit
        self.waiting.remove(rid)
        self.running.append(rid)
        self._after_allocate(req, num_hit, n)

    @precondition(lambda self: any(
        self._idle(r) and self.reqs[r].num_computed_tokens < self.reqs[r].num_tokens for r in self.running))
    @rule(data=st.data())
    def schedule_chunk(self, data):
        kv, bs = self.kv, self.kv.block_size
        rid = data.draw(st.sampled_from([
            r for r in self.running if self._idle(r) and self.reqs[r].num_computed_tokens < self.reqs[r].num_tokens]))
        req = self.reqs[rid]
        start = req.num_computed_tokens
        n = data.draw(st.integers(1, req.num_tokens - start))
        before = self._snapshot()
        blocks = self.blocks[rid]
        for i in range(min(self._skipped(start), len(blocks))):  # freed even if the chunk does not fit
            blocks[i] = NULL_BLOCK
        need = cdiv(start + n, bs) - len(blocks)
        new = kv.allocate_slots(req, n)
        if new is None:
            if self.window is None:
                assert self._snapshot() == before, "a refused allocation changed state"
            assert need > kv.get_num_free_blocks(), "refused although it fits"
            return
        assert len(new) == max(need, 0)
        for b in new:
            self.model.kv[b.block_id] = [None] * bs
        self.blocks[rid].extend(new)
        self._after_allocate(req, start, n)

    @precondition(lambda self: self.pending)
    @rule()
    def model_step(self):
        """Write the K/V of every scheduled chunk, then attend: each request reads its whole prefix."""
        for rid, (start, n) in self.pending.items():
            req = self.reqs[rid]
            self.model.write([b.block_id for b in self.blocks[rid]], req.all_token_ids, start, n)
        for rid, (start, n) in self.pending.items():
            req = self.reqs[rid]
            self.model.check_read([b.block_id for b in self.blocks[rid]], req.all_token_ids, start + n, rid,
                                  first_key(start, self.window))
        for rid, (start, n) in self.pending.items():
            req = self.reqs[rid]
            assert req.num_computed_tokens == start
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids([self.rng.choice(ALPHABET)])
        self.pending.clear()

    def _drop(self, rid: str) -> None:
        req = self.reqs[rid]
        had_blocks = rid in self.running
        before = self._snapshot()
        self.kv.free(req)
        if not had_blocks:
            assert self._snapshot() == before, "freeing a request without blocks changed state"
        assert rid not in self.kv.req_to_blocks and rid not in self.kv.num_cached_block
        self.blocks.pop(rid, None)
        if had_blocks:
            self.running.remove(rid)
        else:
            self.waiting.remove(rid)

    @precondition(lambda self: any(self._idle(r) for r in self.running))
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from([r for r in self.running if self._idle(r)]))
        self._drop(rid)
        del self.reqs[rid]

    @precondition(lambda self: any(self._idle(r) for r in self.running))
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from([r for r in self.running if self._idle(r)]))
        self._drop(rid)
        self.reqs[rid].num_computed_tokens = 0
        self.waiting.append(rid)

    @precondition(lambda self: self.waiting or any(self._idle(r) for r in self.running))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.waiting + [r for r in self.running if self._idle(r)]))
        self._drop(rid)
        del self.reqs[rid]

    @precondition(lambda self: not self.pending)
    @rule()
    def finish_all(self):
        for rid in list(self.reqs):
            self._drop(rid)
        self.reqs.clear()
        self._check_all_free()

    def _check_all_free(self):
        kv = self.kv
        assert kv.get_num_free_blocks() == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
        assert kv.req_to_blocks == {} and kv.num_cached_block == {}
        assert kv.usage == 0.0

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def blocks_consistent(self):
        if self.kv is None:
            return
        check_block_invariants(self.kv, {rid: self.blocks[rid] for rid in self.running})
        for rid in self.running:
            check_request_hashes(self.kv, self.reqs[rid])
            blocks = self.blocks[rid]
            req = self.reqs[rid]
            start, n = self.pending.get(rid, (req.num_computed_tokens, 0))
            assert len(blocks) == cdiv(start + n, self.kv.block_size)
            assert self.kv.num_cached_block.get(rid, 0) <= (start + n) // self.kv.block_size
        for rid in self.waiting:
            assert rid not in self.kv.req_to_blocks

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        if self.kv is None or self.pending:
            return  # mid-step, freshly registered blocks are written by the coming model step
        for key, block in self.kv.block_pool.cached_block_hash_to_block.items():
            self.model.check_cached_block(block.block_id, key)

    def teardown(self):
        if self.kv is None:
            return
        self.pending.clear()
        for rid in list(self.reqs):
            self._drop(rid)
        self._check_all_free()


# ---- the real scheduler with a fake model runner --------------------------------------------------


class FakeRunner:
    """Keeps per-request token lists and block tables from SchedulerOutput deltas only."""

    def __init__(self, block_size: int, num_blocks: int, window: Optional[int] = None) -> None:
        self.block_size = block_size
        self.window = window
        self.model = KVModel(num_blocks, block_size)
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def execute(self, so, rng: random.Random, vocab) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(rid, None)
            self.block_ids.pop(rid, None)
            self.num_computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} arrives as new while held"
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.block_ids[new.req_id] = list(new.block_ids[0])  # the one KV cache group
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        assert len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens)
        for rid, new_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            assert rid in self.tokens, f"{rid} scheduled as cached but not held by the runner"
            assert self.num_computed[rid] == num_computed
            self.block_ids[rid].extend(new_ids[0])
        new_ids = [d.req_id for d in so.scheduled_new_reqs]
        assert len(set(new_ids)) == len(new_ids)
        assert set(new_ids).isdisjoint(cached.req_ids)
        assert set(new_ids) | set(cached.req_ids) == set(so.num_scheduled_tokens)
        # Write every chunk, then attend.
        for rid, n in so.num_scheduled_tokens.items():
            assert n >= 1
            start = self.num_computed[rid]
            assert start + n <= len(self.tokens[rid])
            self.model.write(self.block_ids[rid], self.tokens[rid], start, n)
        for rid, n in so.num_scheduled_tokens.items():
            start = self.num_computed[rid]
            self.model.check_read(self.block_ids[rid], self.tokens[rid], start + n, rid, first_key(start, self.window))
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            self.num_computed[rid] += n
            at_end = self.num_computed[rid] == len(self.tokens[rid])
            assert (rid in so.sample_req_ids) == at_end
            if at_end:
                token = rng.choice(vocab)
                req_ids.append(rid)
                sampled.append([token])
                self.tokens[rid].append(token)
        assert so.sample_req_ids <= set(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


VOCAB = (0, 1, 2, 3)
EOS = 3


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Optional[Scheduler] = None
        self.next_id = 0
        self.known: dict[str, Request] = {}  # every request ever added
        self.done: dict[str, str] = {}  # rid -> finish reason seen
        self.outputs: dict[str, list[int]] = {}

    @initialize(policy=st.sampled_from(["fcfs", "priority"]), max_num_seqs=st.integers(1, 4),
                max_num_batched_tokens=st.integers(2, 16), threshold=st.sampled_from([0, 0, 2, 3, 5]),
                partial=st.integers(1, 2), num_blocks=st.integers(3, 8),
                block_size=st.sampled_from([1, 2, 4]), enable_caching=st.booleans(),
                seed=st.integers(0, 2 ** 16), window=st.sampled_from([None, None, 1, 2, 3, 5]))
    def init(self, policy, max_num_seqs, max_num_batched_tokens, threshold, partial, num_blocks, block_size,
             enable_caching, seed, window):
        # max_model_len is the pool's capacity: any single request fits alone, so draining terminates.
        self.max_model_len = num_blocks * block_size
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=self.max_model_len, policy=policy,
                                      long_prefill_token_threshold=threshold, max_num_partial_prefills=partial)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching, sliding_window=window)
        self.sched = Scheduler(self.config, self.kv)
        self.runner = FakeRunner(block_size, num_blocks, window)
        self.rng = random.Random(seed)

    @precondition(lambda self: self.sched is not None)
    @rule(data=st.data())
    def add_request(self, data):
        max_prompt = min(self.max_model_len - 1, 14)
        if self.known and data.draw(st.booleans()):
            # A prefix of an earlier request's tokens (prompt + outputs): sure prefix hits.
            src = self.known[data.draw(st.sampled_from(sorted(self.known)))]
            prompt = src.all_token_ids[:data.draw(st.integers(1, min(max_prompt, src.num_tokens)))]
        else:
            prompt = data.draw(prompts(max_prompt))
        max_tokens = data.draw(st.integers(1, 8))
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=data.draw(st.integers(0, max_tokens)),
                            ignore_eos=data.draw(st.booleans()),
                            stop_token_ids=data.draw(st.sampled_from([[], [], [2]])))
        rid = f"r{self.next_id}"
        req = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                      eos_token_ids=data.draw(st.sampled_from([(), (EOS,)])),
                      arrival_time=float(self.next_id), priority=data.draw(st.integers(0, 2)))
        self.next_id += 1
        self.sched.add_request(req)
        self.known[rid] = req
        self.outputs[rid] = []

    def _step(self):
        sched, cfg = self.sched, self.config
        had_requests = sched.has_unfinished_requests()
        so = sched.schedule()
        if had_requests:
            # Liveness: something runs, or the step made room by preempting.
            assert so.total_num_scheduled_tokens > 0 or so.preempted_req_ids
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert so.preempted_req_ids.isdisjoint(so.num_scheduled_tokens)
        if so.preempted_req_ids and not sched.suspects:  # isolation puts a cleared suspect back
            assert not so.scheduled_new_reqs, "nothing is admitted in a step that preempts"
        if cfg.policy == "fcfs":
            arrivals = [sched.requests[d.req_id].arrival_time for d in so.scheduled_new_reqs]
            assert arrivals == sorted(arrivals), "FCFS admitted requests out of arrival order"
        if cfg.long_prefill_token_threshold:
            assert all(n <= cfg.long_prefill_token_threshold for n in so.num_scheduled_tokens.values())
        for rid in so.num_scheduled_tokens:
            assert sched.requests[rid].status == RequestStatus.RUNNING
            # Blocks behind the window of the step's first query are freed (-1), and only those.
            held, bs = self.kv.get_block_ids(rid), self.kv.block_size
            skipped = first_key(sched.requests[rid].num_computed_tokens - so.num_scheduled_tokens[rid],
                                self.kv.sliding_window) // bs
            assert held[:skipped] == [-1] * min(skipped, len(held)) and -1 not in held[skipped:]
        mro = self.runner.execute(so, self.rng, VOCAB)
        # The runner's view, rebuilt from deltas only, matches the scheduler's (where the runner may read).
        for rid in so.num_scheduled_tokens:
            req = sched.requests[rid]
            held = self.kv.get_block_ids(rid)
            live = held.count(-1)
            assert self.runner.block_ids[rid][live:] == held[live:] and len(self.runner.block_ids[rid]) == len(held)
            assert self.runner.tokens[rid] == req.all_token_ids + ([mro.sampled_token_ids[mro.req_ids.index(rid)][0]]
                                                                   if rid in mro.req_ids else [])
            assert self.runner.num_computed[rid] == req.num_computed_tokens
        outs = sched.update_from_output(so, mro)
        sched.on_step_succeeded(so)
        if sched.suspects:
            assert len(sched.running) <= 1, "isolation runs one request at a time"
        sampled = dict(zip(mro.req_ids, mro.sampled_token_ids))
        for out in outs:
            rid = out.request_id
            assert rid in sampled and out.new_token_ids == sampled[rid]
            self.outputs[rid].extend(out.new_token_ids)
            req = self.known[rid]
            assert req.output_token_ids == self.outputs[rid]
            if out.finished:
                assert rid not in sched.requests
                self.done[rid] = out.finish_reason
                self._check_stop_reason(req, out.finish_reason)
            else:
                assert rid in sched.requests
                self._check_not_stopped(req)
        assert {o.request_id for o in outs} == set(sampled)
        return so

    def _check_stop_reason(self, req: Request, reason: str) -> None:
        sp, last = req.sampling_params, req.output_token_ids[-1]
        if reason == "stop":
            assert req.num_output_tokens >= sp.min_tokens
            assert (last in req.eos_token_ids and not sp.ignore_eos) or last in sp.stop_token_ids
            if last in sp.stop_token_ids and not (last in req.eos_token_ids and not sp.ignore_eos):
                assert req.stop_reason == last
        else:
            assert reason == "length", reason
            assert req.num_output_tokens == sp.max_tokens or req.num_tokens == self.max_model_len
        assert req.num_output_tokens <= sp.max_tokens
        assert req.num_tokens <= self.max_model_len

    def _check_not_stopped(self, req: Request) -> None:
        sp, last = req.sampling_params, req.output_token_ids[-1]
        assert req.num_output_tokens < sp.max_tokens and req.num_tokens < self.max_model_len
        if req.num_output_tokens >= sp.min_tokens:
            assert last not in sp.stop_token_ids
            assert sp.ignore_eos or last not in req.eos_token_ids

    @precondition(lambda self: self.sched is not None)
    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            self._step()

    @precondition(lambda self: self.sched is not None and self.sched.has_unfinished_requests())
    @rule()
    def failed_step(self):
        """The runner raises before its forward (nothing written): the step's lone request fails,
        or all running requests are recomputed with the scheduled ones isolated."""
        sched = self.sched
        so = sched.schedule()
        self.runner.tokens.clear()  # the real runner discards its batch state (ModelRunner.reset)
        self.runner.block_ids.clear()
        self.runner.num_computed.clear()
        scheduled = set(so.num_scheduled_tokens)
        failed = sched.handle_step_failure(so)
        assert not sched.running
        if len(scheduled) == 1:
            assert {r.request_id for r in failed} == scheduled
        else:
            assert not failed and scheduled <= set(sched.suspects)
        for req in failed:
            assert req.status == RequestStatus.FINISHED_ERROR and req.request_id not in self.kv.req_to_blocks
            self.done[req.request_id] = "error"
        assert self.kv.get_num_free_blocks() == self.kv.num_blocks

    @precondition(lambda self: self.sched is not None)
    @rule(data=st.data())
    def abort(self, data):
        sched = self.sched
        candidates = sorted(sched.requests) + sorted(self.done) + ["unknown"]
        ids = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3))
        live_before = {rid for rid in ids if rid in sched.requests}
        finished = sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        assert {r.request_id for r in finished} == live_before
        assert len(finished) == len(live_before)  # a repeated id is aborted once
        for req in finished:
            assert req.status == RequestStatus.FINISHED_ABORTED and req.get_finished_reason() == "abort"
            assert req.request_id not in sched.requests
            assert req.request_id not in self.kv.req_to_blocks
            self.done[req.request_id] = "abort"

    @precondition(lambda self: self.sched is not None)
    @rule()
    def drain(self):
        """Run to completion without new arrivals; every request must finish."""
        for _ in range(1000):
            if not self.sched.has_unfinished_requests():
                break
            self._step()
        self._check_all_done()

    def _check_all_done(self):
        sched, kv = self.sched, self.kv
        assert not sched.has_unfinished_requests(), "the scheduler stopped making progress"
        assert sched.requests == {} and sched.running == []
        assert not sched.waiting and not sched.skipped_waiting
        assert kv.get_num_free_blocks() == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
        assert kv.req_to_blocks == {}
        assert set(self.done) == set(self.known)

    @invariant()
    def scheduler_consistent(self):
        sched = self.sched
        if sched is None:
            return
        cfg = self.config
        assert len(sched.running) <= cfg.max_num_seqs
        where: dict[str, list[str]] = {rid: [] for rid in sched.requests}
        for name, coll in (("waiting", sched.waiting), ("skipped_waiting", sched.skipped_waiting),
                           ("running", sched.running)):
            for req in coll:
                assert req.request_id in where, f"{req.request_id} in {name} but not in scheduler.requests"
                assert sched.requests[req.request_id] is req
                where[req.request_id].append(name)
        for rid, places in where.items():
            assert len(places) == 1, f"{rid} is in {places}"
            req = sched.requests[rid]
            assert not req.is_finished
            if places == ["running"]:
                assert req.status == RequestStatus.RUNNING
                assert 0 < req.num_computed_tokens <= req.num_tokens
            else:
                assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                assert req.num_computed_tokens == 0
        assert set(sched.requests).isdisjoint(self.done)
        if cfg.policy == "fcfs":
            # FCFS: both queues stay in arrival order (preempted requests included).
            for queue in (sched.waiting, sched.skipped_waiting):
                arrivals = [r.arrival_time for r in queue]
                assert arrivals == sorted(arrivals), f"queue out of arrival order: {list(queue)}"
        check_block_invariants(self.kv, {r.request_id: self.kv.req_to_blocks[r.request_id]
                                         for r in sched.running if r.request_id in self.kv.req_to_blocks})
        assert set(self.kv.req_to_blocks) == {r.request_id for r in sched.running}
        for req in sched.running:
            check_request_hashes(self.kv, req)
            assert len(self.kv.req_to_blocks[req.request_id]) * self.kv.block_size >= req.num_computed_tokens
        for key, block in self.kv.block_pool.cached_block_hash_to_block.items():
            self.runner.model.check_cached_block(block.block_id, key)

    def teardown(self):
        if self.sched is None:
            return
        self.sched.finish_requests(list(self.sched.requests), RequestStatus.FINISHED_ABORTED)
        for rid in self.known:
            self.done.setdefault(rid, "abort")
        self._check_all_done()


TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase
TestKVCacheManagerMachine.settings = SETTINGS
TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = SETTINGS

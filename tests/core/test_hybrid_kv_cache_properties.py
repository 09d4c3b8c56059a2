"""Stateful property test of the KV cache manager over several KV cache groups and a recurrent-state group.

`HybridKVCacheMachine` drives KVCacheManager as the scheduler does for hybrid models: a full-attention group,
sliding-window groups, and (or) recurrent-state slots with states saved at prompts' last block boundaries.
A simulated model keeps, per group, what every KV slot holds (the token prefix ending there, what a real K/V
depends on) and per state slot the tokens the state has consumed; every step checks that each request reads
exactly its own prefix in every group (its window in a sliding one) and that its state holds exactly the
tokens before its chunk, then saves and restores states as the manager says.

Invariants after every rule: a block is referenced as many times as block lists hold it (across all groups),
is in one group at a time, free blocks are exactly those referenced by nobody; running requests' state slots
are distinct and never a cache slot; everything comes back when every request is gone.
"""

from __future__ import annotations

from typing import Optional

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vlite.core.kv_cache_manager import KVCacheManager, cdiv
from vlite.core.kv_cache_utils import NULL_BLOCK
from vlite.request import Request
from vlite.sampling_params import SamplingParams

ALPHABET = (0, 1)
PREFIXES = ((), (0, 0, 0, 0, 0, 0, 0, 0), (0, 1, 0, 1, 0, 1))
SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def prompts():
    return st.builds(lambda p, s: (list(p) + s)[:14] or [0], st.sampled_from(PREFIXES),
                     st.lists(st.sampled_from(ALPHABET), max_size=6))


class HybridKVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: Optional[KVCacheManager] = None
        self.reqs: dict[str, Request] = {}
        self.waiting: list[str] = []
        self.running: dict[str, tuple[int, int]] = {}  # rid -> (start, n) allocated, not yet computed; n 0: idle
        self.next_id = 0

    @initialize(num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 3]), caching=st.booleans(),
                windows=st.sampled_from([(0, 2), (0, 3, 3), (0, 1, 5), (0,), (4,)]),
                state=st.sampled_from([(0, 0), (2, 0), (2, 1), (3, 2)]))
    def init(self, num_blocks, block_size, caching, windows, state):
        running, cached = state
        if not windows[0] and len(windows) == 1 and not running:
            running = 2  # one full group alone is the plain manager: give it a state group
        self.kv = KVCacheManager(num_blocks, block_size, caching, num_state_slots=running + cached,
                                 num_cached_state_slots=cached, group_windows=windows)
        self.windows = windows
        self.slot_kv = [dict() for _ in windows]  # group -> {(block_id, offset): token prefix}
        self.state = {}  # state slot -> tokens consumed
        self.max_running = running or 99

    # ---- rules -------------------------------------------------------------------------------

    @rule(prompt=prompts(), prompt_logprobs=st.integers(0, 7))
    def add(self, prompt, prompt_logprobs):
        rid = f"r{self.next_id}"
        self.next_id += 1
        sp = SamplingParams(prompt_logprobs=1 if prompt_logprobs == 0 else None)
        self.reqs[rid] = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp)
        self.waiting.append(rid)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        kv = self.kv
        rid = data.draw(st.sampled_from(self.waiting))
        req = self.reqs[rid]
        hit, num_hit = kv.get_computed_blocks(req)
        assert num_hit % kv.block_size == 0 and num_hit <= req.num_tokens - 1
        assert all(len(h) == num_hit // kv.block_size for h in hit.per_group)
        n = data.draw(st.integers(1, req.num_tokens - num_hit))
        n = kv.cap_new_tokens(req, num_hit, n)
        assert n >= 1
        new = kv.allocate_slots(req, n, num_hit, hit)
        if new is None:
            return
        self.waiting.remove(rid)
        req.num_computed_tokens = num_hit
        self.running[rid] = (num_hit, n)
        if kv.state_manager is not None:
            slot, source = kv.state_slot(rid), kv.state_restore_source(rid)
            assert slot >= 0
            # the runner: the slot starts from zeros, or from the saved state the hit ends with
            self.state[slot] = tuple(self.state[source]) if source >= 0 else ()
            assert len(self.state[slot]) == num_hit, "a state restored for another prefix length"

    @precondition(lambda self: any(n == 0 for _, n in self.running.values()))
    @rule(data=st.data())
    def schedule(self, data):
        """Allocate the next chunk of an idle running request (its prompt, or one decode token)."""
        kv = self.kv
        rid = data.draw(st.sampled_from(sorted(r for r, (_, n) in self.running.items() if n == 0)))
        req = self.reqs[rid]
        start = req.num_computed_tokens
        if start >= req.num_tokens:
            req.append_output_token_ids([data.draw(st.sampled_from(ALPHABET))])
        n = data.draw(st.integers(1, req.num_tokens - start))
        n = kv.cap_new_tokens(req, start, n)
        if kv.allocate_slots(req, n) is None:
            self._release(rid)  # preempted: everything back, it recomputes from its prompt
            self.waiting.append(rid)
            return
        self.running[rid] = (start, n)

    @precondition(lambda self: any(n for _, n in self.running.values()))
    @rule()
    def step(self):
        """The model step: write this step's K/V in every group, read each request's own keys, advance states;
        then the states the manager asks for are saved and become visible from the next step."""
        kv, bs = self.kv, self.kv.block_size
        saves = []
        chunks = [(rid, start, n) for rid, (start, n) in sorted(self.running.items()) if n]
        for rid, start, n in chunks:  # every K/V of the step is written before any attention reads (per layer)
            tokens, ids = self.reqs[rid].all_token_ids, kv.get_group_block_ids(rid)
            for g in range(len(self.windows)):
                assert len(ids[g]) >= cdiv(start + n, bs)
                for p in range(start, start + n):
                    assert ids[g][p // bs] >= 0
                    self.slot_kv[g][ids[g][p // bs], p % bs] = tuple(tokens[:p + 1])
        for rid, start, n in chunks:
            req = self.reqs[rid]
            tokens, ids = req.all_token_ids, kv.get_group_block_ids(rid)
            for g, window in enumerate(self.windows):
                for p in range(start, start + n):
                    first = max(0, p - window + 1) if window else 0
                    for q in range(first, p + 1):
                        block = ids[g][q // bs]
                        assert block >= 0, f"{rid} reads position {q} of group {g} from a freed block"
                        assert self.slot_kv[g].get((block, q % bs)) == tuple(tokens[:q + 1]), (rid, g, q)
            if kv.state_manager is not None:
                slot = kv.state_slot(rid)
                assert self.state[slot] == tuple(tokens[:start]), f"{rid}'s state saw other tokens"
                self.state[slot] = tuple(tokens[:start + n])
            req.num_computed_tokens = start + n
            self.running[rid] = (start + n, 0)
            save = kv.schedule_state_save(req)
            if save is not None:
                saves.append(save)
        for src, dst in saves:  # the runner, after the forward
            assert dst >= kv.state_manager.num_running_slots
            self.state[dst] = self.state[src]
        kv.new_step()

    @precondition(lambda self: any(n == 0 for _, n in self.running.values()))
    @rule(data=st.data(), preempt=st.booleans())
    def finish(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(r for r, (_, n) in self.running.items() if n == 0)))
        self._release(rid)
        if preempt:
            self.waiting.append(rid)
        else:
            del self.reqs[rid]

    def _release(self, rid: str) -> None:
        self.kv.free(self.reqs[rid])
        self.reqs[rid].num_computed_tokens = 0
        del self.running[rid]

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def blocks_consistent(self):
        kv = self.kv
        if kv is None:
            return
        pool = kv.block_pool
        counts = [0] * pool.num_blocks
        owner: dict[int, int] = {}
        for g, manager in enumerate(kv.groups):
            assert set(manager.req_to_blocks) <= set(self.running)
            for rid, blocks in manager.req_to_blocks.items():
                live = [b for b in blocks if b is not NULL_BLOCK]
                assert len({b.block_id for b in live}) == len(live), f"{rid} holds a block twice in group {g}"
                for b in live:
                    counts[b.block_id] += 1
                    assert owner.setdefault(b.block_id, g) == g, f"block {b.block_id} in two groups"
        free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
        for block in pool.blocks:
            assert block.ref_cnt == counts[block.block_id], block
            assert (block.ref_cnt == 0) == (block.block_id in free), block
        state = kv.state_manager
        if state is not None:
            slots = [state.slot(rid) for rid in self.running]
            assert all(0 <= s < state.num_running_slots for s in slots)
            assert len(set(slots)) == len(slots), f"two running requests share a state slot: {slots}"
            assert not set(slots) & set(state.free_slots)
            cache_slots = list(state.cached.values()) + state.free_cache_slots
            assert len(set(cache_slots)) == len(cache_slots)

    def teardown(self):
        kv = self.kv
        if kv is None:
            return
        for rid in list(self.running):
            self._release(rid)
        assert kv.get_num_free_blocks() == kv.num_blocks
        if kv.state_manager is not None:
            assert len(kv.state_manager.free_slots) == kv.state_manager.num_running_slots


TestHybridKVCacheMachine = HybridKVCacheMachine.TestCase
TestHybridKVCacheMachine.settings = SETTINGS

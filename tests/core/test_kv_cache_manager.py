"""Unit tests for vlite.core.kv_cache_manager: block tables, prefix caching, eviction order, stats.

block_size 4 and ten blocks throughout unless said otherwise; real Request objects.
"""

from __future__ import annotations

import pytest

from vlite.core.kv_cache_manager import KVCacheManager, cdiv
from vlite.core.kv_cache_utils import NULL_BLOCK, hash_block_tokens
from vlite.request import Request
from vlite.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int], **sp) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams(**sp),
                   arrival_time=0.0)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def chain(tokens: list[int]) -> list:
    """The expected chained hashes of the full blocks of `tokens`."""
    out, parent = [], None
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = hash_block_tokens(parent, tokens[start:start + BS])
        out.append(parent)
    return out


def admit(kv: KVCacheManager, req: Request, num_new_tokens: int | None = None):
    """What the scheduler does for a waiting request: lookup, allocate, set num_computed_tokens."""
    hit, num_hit = kv.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_hit
    new = kv.allocate_slots(req, num_new_tokens, num_hit, hit)
    if new is not None:
        req.num_computed_tokens = num_hit
    return new, hit, num_hit


def compute(req: Request, n: int, sampled: int | None = None) -> None:
    """The model computed n tokens; optionally sample one more."""
    req.num_computed_tokens += n
    assert req.num_computed_tokens <= req.num_tokens
    if sampled is not None:
        assert req.num_computed_tokens == req.num_tokens
        req.append_output_token_ids([sampled])


def run_prompt(kv: KVCacheManager, req: Request, sampled: int | None = None):
    new, hit, num_hit = admit(kv, req)
    assert new is not None
    compute(req, req.num_tokens - num_hit, sampled)
    return new, hit


def snapshot(kv: KVCacheManager):
    pool = kv.block_pool
    return (free_ids(kv), [b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
            dict(pool.cached_block_hash_to_block), {k: ids(v) for k, v in kv.req_to_blocks.items()},
            dict(kv.num_cached_block), vars(kv.prefix_cache_stats).copy())


@pytest.fixture
def kv() -> KVCacheManager:
    return KVCacheManager(num_blocks=10, block_size=BS)


def test_cdiv():
    assert [cdiv(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_grows_across_decode_steps(kv):
    req = make_req("a", [1, 2, 3, 4, 5, 6])
    new = kv.allocate_slots(req, 6)
    assert ids(new) == [0, 1]
    compute(req, 6, sampled=7)  # 7 tokens, 6 computed
    assert kv.allocate_slots(req, 1) == []  # position 6 fits in block 1
    compute(req, 1, sampled=8)  # 8 tokens
    assert kv.allocate_slots(req, 1) == []  # position 7 still fits
    compute(req, 1, sampled=9)  # 9 tokens: position 8 starts block 2
    assert ids(kv.allocate_slots(req, 1)) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert free_ids(kv) == list(range(3, 10))
    assert kv.get_num_free_blocks() == 7
    assert kv.usage == pytest.approx(0.3)
    assert kv.num_blocks == 10
    assert kv.get_block_ids("nope") == []


def test_allocate_chunked_prefill(kv):
    prompt = list(range(100, 110))  # 10 tokens
    req = make_req("a", prompt)
    assert ids(kv.allocate_slots(req, 4)) == [0]
    compute(req, 4)
    assert ids(kv.allocate_slots(req, 3)) == [1]  # positions 4..6
    compute(req, 3)
    assert ids(kv.allocate_slots(req, 3)) == [2]  # positions 7..9
    compute(req, 3, sampled=1)
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_allocate_returns_none_and_changes_nothing(kv):
    a = make_req("a", list(range(30)))  # 8 blocks
    run_prompt(kv, a)
    assert kv.get_num_free_blocks() == 2
    b = make_req("b", list(range(50, 62)))  # needs 3 blocks
    before = snapshot(kv)
    hit, num_hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 12, num_hit, hit) is None
    assert snapshot(kv) == before
    assert "b" not in kv.req_to_blocks
    # A running request that cannot grow keeps its blocks.
    b2 = make_req("b2", list(range(70, 78)))  # exactly the 2 free blocks
    assert ids(kv.allocate_slots(b2, 8)) == [8, 9]
    compute(b2, 8, sampled=5)  # 9 tokens: needs a 3rd block
    before = snapshot(kv)
    assert kv.allocate_slots(b2, 1) is None
    assert snapshot(kv) == before
    assert kv.get_block_ids("b2") == [8, 9]


def test_free_cached_hits_count_against_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a = make_req("a", prefix + [9])
    run_prompt(kv, a)  # blocks 0 1 2, 0 and 1 cached
    kv.free(a)
    assert free_ids(kv) == [2, 1, 0]
    # b hits the two free cached blocks and needs 2 more: only 1 block is left beyond the hits.
    b = make_req("b", prefix + [20, 21, 22, 23, 24])
    hit, num_hit = kv.get_computed_blocks(b)
    assert ids(hit) == [0, 1] and num_hit == 8
    before = snapshot(kv)
    assert kv.allocate_slots(b, 5, num_hit, hit) is None
    assert snapshot(kv) == before
    # With one block needed it fits: the hits leave the queue, block 2 is the new one.
    c = make_req("c", prefix + [30, 31])
    hit, num_hit = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, 2, num_hit, hit)
    assert ids(new) == [2]
    assert kv.get_block_ids("c") == [0, 1, 2]
    assert free_ids(kv) == []


def test_get_computed_blocks_full_blocks_only(kv):
    a_prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    a = make_req("a", a_prompt)
    run_prompt(kv, a)
    cached = kv.req_to_blocks["a"]
    assert [b.block_hash for b in cached] == chain(a_prompt) + [None]

    def hits(tokens):
        blocks, n = kv.get_computed_blocks(make_req("q", tokens))
        return ids(blocks), n

    assert hits(a_prompt[:8] + [99, 98]) == ([0, 1], 8)
    assert hits(a_prompt[:7] + [99, 98, 97]) == ([0], 4)  # second block differs in its last token
    assert hits(a_prompt[:3]) == ([], 0)  # no full block
    assert hits([0] + a_prompt[1:]) == ([], 0)  # first block differs
    # Block 1's tokens after a different first block: chaining means no hit.
    assert hits([50, 51, 52, 53] + a_prompt[4:8] + [1]) == ([], 0)
    # The last token is always recomputed: a prompt of exactly the cached blocks hits one less.
    assert hits(a_prompt[:8]) == ([0], 4)
    assert hits(a_prompt[:9]) == ([0, 1], 8)
    assert hits(a_prompt) == ([0, 1], 8)
    # Lookup does not take references.
    assert [b.ref_cnt for b in cached] == [1, 1, 1]


def test_fully_cached_prompt_still_recomputes_a_token(kv):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]  # exactly 2 blocks
    a = make_req("a", prompt)
    run_prompt(kv, a, sampled=1)
    b = make_req("b", prompt)
    new, hit, num_hit = admit(kv, b)
    assert ids(hit) == [0] and num_hit == 4
    assert b.num_tokens - num_hit == 4 >= 1
    assert ids(new) == [2]
    # b's block 1 duplicates a's cached block 1: the map keeps a's.
    assert kv.block_pool.get_cached_block(chain(prompt)[1]) is kv.req_to_blocks["a"][1]
    assert kv.req_to_blocks["b"][1].block_hash is None


def test_hit_blocks_ref_cnt(kv):
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    run_prompt(kv, a)
    b = make_req("b", prompt[:8] + [77, 78, 79])
    new, hit, num_hit = admit(kv, b)
    assert ids(hit) == [0, 1] and ids(new) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    pool = kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert free_ids(kv)[-1] == 2
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    assert kv.req_to_blocks == {} and kv.num_cached_block == {}
    kv.free(b)  # freeing twice is harmless: nothing left to free
    assert kv.get_num_free_blocks() == 10


def test_hit_on_free_cached_blocks_pulls_them_from_queue(kv):
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    run_prompt(kv, a)
    kv.free(a)
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    b = make_req("b", prompt[:8] + [42])
    new, hit, num_hit = admit(kv, b)
    assert ids(hit) == [0, 1] and num_hit == 8
    assert ids(new) == [3]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 2]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 3)] == [1, 1, 1]


def test_free_evicts_tail_blocks_before_prefix(kv):
    prompt = list(range(1, 13))  # 3 full blocks
    a = make_req("a", prompt + [13])  # 4 blocks; the last one partial
    run_prompt(kv, a)
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    kv.free(a)
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    filler = make_req("f", list(range(200, 224)))  # 6 blocks: all never-used ones
    run_prompt(kv, filler)
    assert kv.get_block_ids("f") == [4, 5, 6, 7, 8, 9]
    one = make_req("g", [300])
    run_prompt(kv, one)
    assert kv.get_block_ids("g") == [3]  # a's partial tail goes first
    two = make_req("h", [301])
    run_prompt(kv, two)
    assert kv.get_block_ids("h") == [2]  # then a's last full block, evicted
    pool = kv.block_pool
    assert pool.blocks[2].block_hash is None
    assert pool.get_cached_block(chain(prompt)[2]) is None
    # The prefix blocks survive and still hit.
    blocks, n = kv.get_computed_blocks(make_req("q", prompt + [0]))
    assert ids(blocks) == [0, 1] and n == 8


def test_prefix_cache_stats_once_per_admission(kv):
    prompt = list(range(1, 11))
    stats = kv.prefix_cache_stats
    a = make_req("a", prompt)
    run_prompt(kv, a, sampled=1)
    assert (stats.requests, stats.queries, stats.hits) == (1, 10, 0)
    kv.allocate_slots(a, 1)  # a decode step is not an admission
    assert (stats.requests, stats.queries, stats.hits) == (1, 10, 0)

    b = make_req("b", prompt[:8] + [50])
    run_prompt(kv, b)
    assert (stats.requests, stats.queries, stats.hits) == (2, 19, 8)

    # A request that does not fit is not counted until it is admitted.
    big = make_req("big", prompt[:8] + list(range(60, 80)))  # 28 tokens: 2 hits + 5 new blocks
    hit, n = kv.get_computed_blocks(big)
    assert kv.get_num_free_blocks() == 6  # a: 3 blocks, b: 2 hits + 1
    filler = make_req("f", list(range(1000, 1008)))  # 2 blocks: 4 left for 5 needed
    run_prompt(kv, filler)
    assert kv.allocate_slots(big, big.num_tokens - n, n, hit) is None
    assert (stats.requests, stats.queries, stats.hits) == (3, 27, 8)  # only the filler counted
    kv.free(filler)
    assert kv.allocate_slots(big, big.num_tokens - n, n, hit) is not None
    assert (stats.requests, stats.queries, stats.hits) == (4, 55, 16)

    # Preemption (free + recompute) is a new admission.
    kv.free(b)
    b.num_computed_tokens = 0
    run_prompt(kv, b)
    assert (stats.requests, stats.queries, stats.hits) == (5, 64, 24)


def test_eager_caching_in_the_same_step(kv):
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    # First chunk of 8 tokens: both blocks are registered before the model runs.
    new = kv.allocate_slots(a, 8)
    assert ids(new) == [0, 1]
    assert [b.block_hash for b in new] == chain(prompt)
    assert kv.num_cached_block["a"] == 2
    # Another request scheduled later in the same step shares them.
    b = make_req("b", prompt[:8] + [7])
    hit, n = kv.get_computed_blocks(b)
    assert ids(hit) == [0, 1] and n == 8
    # A chunk that ends inside a block registers only the blocks it completes.
    c = make_req("c", list(range(40, 50)))
    kv.allocate_slots(c, 6)
    assert [blk.block_hash is not None for blk in kv.req_to_blocks["c"]] == [True, False]
    compute(c, 6)
    kv.allocate_slots(c, 4)
    assert [blk.block_hash is not None for blk in kv.req_to_blocks["c"]] == [True, True, False]
    assert kv.num_cached_block["c"] == 2


def test_decode_fills_a_block_and_caches_it(kv):
    prompt = [1, 2, 3, 4, 5, 6]
    a = make_req("a", prompt)
    run_prompt(kv, a, sampled=7)
    assert kv.num_cached_block["a"] == 1
    kv.allocate_slots(a, 1)  # computes position 6
    compute(a, 1, sampled=8)  # tokens 1..8: block 1 is full once position 7 is computed
    assert kv.req_to_blocks["a"][1].block_hash is None
    kv.allocate_slots(a, 1)
    assert kv.req_to_blocks["a"][1].block_hash == chain(list(range(1, 9)))[1]
    assert kv.num_cached_block["a"] == 2


def test_prompt_logprobs_disables_lookup(kv):
    prompt = list(range(1, 11))
    run_prompt(kv, make_req("a", prompt))
    b = make_req("b", prompt, prompt_logprobs=0)
    assert kv.get_computed_blocks(b) == ([], 0)
    new, hit, n = admit(kv, b)
    assert hit == [] and n == 0 and len(new) == 3
    c = make_req("c", prompt, logprobs=2)  # sample logprobs do not matter
    assert ids(kv.get_computed_blocks(c)[0]) == [0, 1]


def test_enable_caching_false():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    run_prompt(kv, a, sampled=3)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    b = make_req("b", prompt)
    assert kv.get_computed_blocks(b) == ([], 0)
    new, _, _ = admit(kv, b)
    assert ids(new) == [3, 4, 5]
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    kv.free(a)
    kv.free(b)
    assert kv.get_num_free_blocks() == 10


def test_reset_prefix_cache(kv):
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    run_prompt(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_req("b", prompt)) == ([], 0)


# ---- sliding window: every layer attends to its last `window` keys ------------------------------------


def test_sliding_window_frees_blocks_behind_the_window():
    """Window 6, blocks of 4: the query at position c reads keys c-5..c, so blocks wholly before
    c - 5 are freed as the request advances; a long generation holds at most 3 blocks."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, sliding_window=6)
    req = make_req("a", list(range(100, 110)))  # 10 prompt tokens
    assert ids(kv.allocate_slots(req, 10)) == [0, 1, 2]  # the first query (position 0) sees everything
    compute(req, 10, sampled=1)
    # next query at position 10 reads keys 5..10: block 0 (positions 0-3) is behind it
    assert kv.allocate_slots(req, 1) == []
    assert kv.get_block_ids("a") == [-1, 1, 2] and kv.get_num_free_blocks() == 8
    assert free_ids(kv)[-1] == 0  # back in the pool, at the tail
    for step in range(30):
        compute(req, 1, sampled=step)
        assert kv.allocate_slots(req, 1) is not None
        held = [b for b in kv.get_block_ids("a") if b >= 0]
        first_key = req.num_computed_tokens - 6 + 1
        assert kv.get_block_ids("a")[:first_key // BS] == [-1] * (first_key // BS)  # exactly those freed
        assert len(held) == cdiv(req.num_computed_tokens + 1, BS) - first_key // BS <= 3
        assert kv.get_num_free_blocks() == 10 - len(held)
    kv.free(req)
    assert kv.get_num_free_blocks() == 10 and kv.req_to_blocks == {}


def test_sliding_window_chunked_prefill_frees_as_it_goes():
    kv = KVCacheManager(num_blocks=10, block_size=BS, sliding_window=5)
    req = make_req("a", list(range(24)))
    kv.allocate_slots(req, 8)
    compute(req, 8)
    # the chunk from position 8 reads keys from 4 on: block 0 goes before blocks are taken for it
    assert len(kv.allocate_slots(req, 8)) == 2 and kv.get_block_ids("a")[:2] == [-1, 1]
    compute(req, 8)
    kv.allocate_slots(req, 8)
    assert kv.get_block_ids("a")[:3] == [-1, -1, -1] and kv.get_num_free_blocks() == 10 - 3


def test_sliding_window_frees_behind_even_when_the_step_does_not_fit():
    """A running request that cannot grow still gives back what it no longer reads (vLLM does too),
    so that it fits more often and preempts less."""
    kv = KVCacheManager(num_blocks=3, block_size=BS, sliding_window=2)
    a = make_req("a", list(range(12)))
    kv.allocate_slots(a, 12)
    compute(a, 12, sampled=1)
    # position 12 needs a fourth block of a full pool; it reads keys 11 and 12, so blocks 0-1 are freed
    # first, and then it fits
    new = kv.allocate_slots(a, 1)
    assert len(new) == 1 and kv.get_block_ids("a") == [-1, -1, 2, new[0].block_id]
    assert kv.get_num_free_blocks() == 1


def test_sliding_window_prefix_hit_leaves_blocks_behind_the_window_alone():
    """Blocks freed behind a window keep their hash: a later request with the same prefix hits them,
    and takes only those its first query reads."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, sliding_window=5)
    a = make_req("a", list(range(16)) + [99])
    run_prompt(kv, a, sampled=1)
    kv.allocate_slots(a, 1)  # position 17 reads keys 13..17: blocks 0-2 freed (still cached)
    assert kv.get_block_ids("a")[:3] == [-1, -1, -1]
    kv.free(a)
    b = make_req("b", list(range(16)) + [7, 8])
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16 and hit[:3] == [NULL_BLOCK] * 3 and hit[3].block_hash == chain(list(range(16)))[3]
    before_free = kv.get_num_free_blocks()
    new = kv.allocate_slots(b, 2, num_hit, hit)
    assert len(new) == 1 and kv.get_num_free_blocks() == before_free - 2  # the hit block 3 and one new
    assert kv.get_block_ids("b") == [-1, -1, -1, hit[3].block_id, new[0].block_id]
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks if blk.block_id not in kv.get_block_ids("b"))
    kv.free(b)
    assert kv.get_num_free_blocks() == 10

"""Cascade attention in plain torch: a shared prefix attended once for a whole batch of decodes.

When B decode requests share their first P KV blocks (a common system prompt, found by prefix
caching), paged decode attention reads those P blocks B times. Cascade attention splits each
query's keys in two parts and merges the partial results exactly through their log-sum-exp (lse):

  prefix:  the P shared blocks, gathered once; all B queries x the prefix keys (one GEMM-shaped pass)
  suffix:  each request's own blocks after the prefix, per request (padded to the longest, masked)
  merge:   o = (e^(lse1 - m) o1 + e^(lse2 - m) o2) / (e^(lse1 - m) + e^(lse2 - m)),  m = max(lse1, lse2)
           lse = m + log(e^(lse1 - m) + e^(lse2 - m))

where for a query, o_i = softmax(s_i) v_i and lse_i = log(sum(exp(s_i))) over part i's (scaled,
soft-capped) scores s_i. A part with no keys has lse = -inf and contributes nothing.

This is the reference math only: nothing here is wired into a backend or the model runner yet. A
later piece adds the cost model that decides when cascading pays (vLLM: `use_cascade_attention`)
and C++/Triton kernels; those must match these functions.

Conventions (vlite's, which differ from vLLM's in places):
  * lse is [tokens, heads] (vLLM's merge_attn_states takes [heads, tokens]), natural log, of the
    scores after `scale` and soft-capping;
  * GQA: query head h reads KV head h // (Hq // Hkv) (as torch_sdpa and the C++ kernel);
  * kv_cache is torch_sdpa's [2, Hkv, num_blocks, block_size, D] (heads outermost);
  * softmax statistics and both matmuls run in float32 (float64 for float64 inputs) whatever the
    input dtype; outputs are cast back to the query's (merge: o1's) dtype, lse stays float32.
"""

from __future__ import annotations

from typing import Optional

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32, float64 for float64: statistics never below float32."""
    return torch.promote_types(dtype, torch.float32)


def _grouped_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                           scale: float, softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Q, Hq, D], k/v [Hkv, N, L, D] (the cache's heads-outermost gather), mask [N, Q, L] or None
    (True = attend) -> out [N, Q, Hq, D] (compute dtype), lse [N, Q, Hq].

    Each KV head serves its Hq // Hkv query heads as G * Q rows of one matmul, without repeating K/V.
    A row with no visible key gets out = 0 and lse = -inf (not NaN), so merging it is a no-op.
    """
    n, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    cdt = _compute_dtype(q.dtype)
    # [Hkv, N, G * Q, D]: query head h = kv * G + g
    qg = q.to(cdt).view(n, q_len, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4).reshape(
        num_kv_heads, n, group * q_len, head_dim)
    scores = torch.matmul(qg, k.to(cdt).transpose(-1, -2)) * scale  # [Hkv, N, G * Q, L]
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(num_kv_heads, n, group, q_len, -1)
    if mask is not None:
        scores = scores.masked_fill_(~mask[None, :, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, N, G, Q]; -inf for a row with no key
    # exp(s - lse) with lse = -inf would be exp(-inf + inf) = NaN: such rows use 0, all their s are -inf
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = torch.matmul(probs.view(num_kv_heads, n, group * q_len, -1), v.to(cdt))  # [Hkv, N, G * Q, D]
    out = out.view(num_kv_heads, n, group, q_len, head_dim).permute(1, 3, 0, 2, 4).reshape(
        n, q_len, num_heads, head_dim)
    return out, lse.permute(1, 3, 0, 2).reshape(n, q_len, num_heads)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k/v [S, Hkv, D] -> out [T, Hq, D] (q's dtype), lse [T, Hq] (float32, or float64).

    Every query sees every key (no causal mask: the shared prefix precedes each decode query).
    S = 0 gives out = 0 and lse = -inf. `softcap`: scores become softcap * tanh(scores / softcap).
    """
    out, lse = _grouped_attention_lse(q[None], k.permute(1, 0, 2)[:, None], v.permute(1, 0, 2)[:, None], None,
                                      scale, softcap)
    return out[0].to(q.dtype), lse[0]


def merge_attn_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                      lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results over disjoint key sets -> the result over their union.

    o1/o2 [T, H, D], lse1/lse2 [T, H]. Exact up to rounding, computed in float32 (float64 for float64
    inputs); o in o1's dtype, lse in the compute dtype. A part with lse = -inf (no keys) contributes
    nothing, whatever its o holds (a kernel may leave it unwritten); both -inf gives o = 0, lse = -inf.
    """
    cdt = _compute_dtype(torch.promote_types(o1.dtype, lse1.dtype))
    lse1, lse2 = lse1.to(cdt), lse2.to(cdt)
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isneginf(m), 0.0, m)  # both empty: keep the exponents finite
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    lse = m + torch.log(total)  # log(0) = -inf when both parts are empty
    # a zero weight must zero its part even where its o is NaN/inf (0 * NaN = NaN)
    part1 = torch.where(w1[..., None] > 0, w1[..., None] * o1.to(cdt), 0.0)
    part2 = torch.where(w2[..., None] > 0, w2[..., None] * o2.to(cdt), 0.0)
    o = (part1 + part2) / torch.where(total > 0, total, 1.0)[..., None]
    return o.to(o1.dtype), lse


def cascade_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                             seq_lens: torch.Tensor, num_common_prefix_blocks: int, block_size: int,
                             scale: float, softcap: Optional[float] = None) -> torch.Tensor:
    """Paged decode attention with the shared prefix's K/V gathered and attended once for the batch.

    query [B, Hq, D]: one decode query per request, at position seq_lens[b] - 1, seeing keys
    0..seq_lens[b] - 1 (its own K/V already written to the cache). kv_cache [2, Hkv, num_blocks,
    block_size, D] (torch_sdpa.get_kv_cache_shape); block_table [B, W]; seq_lens [B]. The first
    `num_common_prefix_blocks` entries must be the same block ids in every row, and every request must
    hold all of them (seq_lens >= P * block_size). No sliding window: a window would hide part of the
    prefix from some queries, which this split does not model. Returns [B, Hq, D] in query's dtype.
    """
    num_reqs = query.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
    assert kv_cache.shape[3] == block_size, (kv_cache.shape, block_size)
    assert block_table.shape[0] == num_reqs == seq_lens.shape[0], (block_table.shape, query.shape, seq_lens.shape)
    block_table, seq_lens = block_table.long(), seq_lens.long()
    p = num_common_prefix_blocks
    prefix_len = p * block_size
    assert 0 <= p <= block_table.shape[1], (p, block_table.shape)
    assert bool((seq_lens > 0).all()), "a decode query sees at least its own key"
    assert bool((seq_lens >= prefix_len).all()), "every request must hold the whole common prefix"
    assert bool((block_table[:, :p] == block_table[:1, :p]).all()), "the prefix blocks differ between requests"
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    cdt = _compute_dtype(query.dtype)

    if p > 0:  # the prefix: gathered once, all B queries x its keys
        ids = block_table[0, :p]
        k = key_cache.index_select(1, ids).view(num_kv_heads, 1, prefix_len, head_dim)
        v = value_cache.index_select(1, ids).view(num_kv_heads, 1, prefix_len, head_dim)
        o_pre, lse_pre = _grouped_attention_lse(query[None], k, v, None, scale, softcap)
        o_pre, lse_pre = o_pre[0], lse_pre[0]
    else:
        o_pre = torch.zeros(query.shape, dtype=cdt)
        lse_pre = torch.full(query.shape[:2], float("-inf"), dtype=cdt)

    suffix_lens = seq_lens - prefix_len
    num_blocks = -(-int(suffix_lens.max()) // block_size)
    if num_blocks == 0:  # every request is exactly the prefix
        return o_pre.to(query.dtype)
    # Each row gathers its blocks from the first after the prefix; rows needing fewer repeat their last
    # block (masked), so no row reads a block id it does not hold (entries past it may be stale or -1).
    last_block = (seq_lens - 1) // block_size
    logical = torch.minimum(p + torch.arange(num_blocks)[None, :], last_block[:, None])
    ids = block_table.gather(1, logical).reshape(-1)
    k = key_cache.index_select(1, ids).view(num_kv_heads, num_reqs, num_blocks * block_size, head_dim)
    v = value_cache.index_select(1, ids).view(num_kv_heads, num_reqs, num_blocks * block_size, head_dim)
    mask = (torch.arange(num_blocks * block_size)[None, :] < suffix_lens[:, None])[:, None, :]  # [B, 1, L]
    o_suf, lse_suf = _grouped_attention_lse(query[:, None], k, v, mask, scale, softcap)
    o, _ = merge_attn_states(o_pre, lse_pre, o_suf[:, 0], lse_suf[:, 0])
    return o.to(query.dtype)

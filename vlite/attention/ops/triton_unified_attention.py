"""Paged attention for a whole step in one Triton launch: prefill chunks and decodes together.

The inputs are the ones the CPU backend's build_metadata takes (vlite.attention.backends.torch_sdpa):

    query_start_loc [B + 1]   request r's query tokens are rows query_start_loc[r] .. query_start_loc[r+1]-1
    seq_lens        [B]       tokens of request r once this step's are written (context + query)
    block_table     [B, M]    key position j of request r lives in block block_table[r, j // block_size]
    k/v cache       [H_kv, num_blocks, block_size, D]   (kv_cache[0] and kv_cache[1])

Request r's query i sits at position p = seq_lens[r] - query_len + i and sees the keys j <= p
(causal inside a chunk, all of the cached context before it), and with a sliding window only
p - window < j. One program serves BLOCK_Q query tokens of one request and the G = H / H_kv query
heads that share one K/V head (GQA), as BLOCK_Q * G rows of one matrix, so each K/V tile is read
once for the whole group:

    grid = (B, cdiv(max_query_len, BLOCK_Q), H_kv)      rows m:  token m // G_PAD, head m % G_PAD

Keys are read in tiles of TILE_N positions, each position through its own block-table entry (any
block size works), with an online softmax in float32. Only entries of keys some query of the
program sees are read: blocks behind every window may be -1 or stale. Soft-capping (Gemma 2)
applies cap * tanh(score / cap) before the mask. Attention sinks (gpt-oss: `sinks` [H] float32) join each
row's softmax denominator after the last tile, as one more score with no value (not with an lse output:
the cascade's passes would count them twice).

Cascade attention (vlite.attention.ops.triton_cascade) runs the same kernel twice, each pass also
writing every row's log-sum-exp (natural log of the scores after scale and soft-capping, -inf for a
row that saw no key) for the merge:

    suffix  key_start = P: each request's own keys P.. (causal, as above), the shared prefix skipped
    prefix  ALL_QUERIES: the step's T query tokens as one sequence, seeing keys 0..P-1 of block-table
            row 0 (the prefix blocks, the same in every row); grid (1, cdiv(T, BLOCK_Q), H_kv), no
            mask needed: every query sits after the prefix
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _unified_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sinks_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr,
                              scale, softcap, window, key_start, key_end, num_tokens,
                              stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                              stride_ch, stride_cb, stride_cs, stride_bt,
                              NUM_QUERIES_PER_KV: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                              ALL_QUERIES: tl.constexpr, STORE_LSE: tl.constexpr, USE_SINKS: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)  # 0 with ALL_QUERIES: block-table row 0 holds the prefix
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    if ALL_QUERIES:  # the step's tokens as one sequence placed right after keys 0..key_end-1
        q_start = 0
        q_len = num_tokens
        ctx = key_end
    else:
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        ctx = tl.load(seq_lens_ptr + seq) - q_len
    if q_block * BLOCK_Q >= q_len:  # a shorter request than the step's longest
        return

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    m = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + m // G_PAD
    g = m % G_PAD
    row_ok = (qi < q_len) & (g < NUM_QUERIES_PER_KV)
    head = kv_head * NUM_QUERIES_PER_KV + g
    pos = ctx + qi
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # The keys some query of this program sees: [lo, hi).
    if ALL_QUERIES:
        hi = key_end
    else:
        hi = ctx + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    lo = key_start  # 0, or the end of a shared prefix attended by another pass
    if USE_WINDOW:
        lo = tl.maximum(ctx + q_block * BLOCK_Q - window + 1, lo)
    row_table = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_base = kv_head.to(tl.int64) * stride_ch

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    n = tl.arange(0, TILE_N)
    for start in range((lo // TILE_N) * TILE_N, hi, TILE_N):
        j = start + n
        j_ok = (j >= lo) & (j < hi)
        block = tl.load(row_table + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        kv_off = head_base + block * stride_cb + (j % BLOCK_SIZE).to(tl.int64) * stride_cs
        k = tl.load(k_ptr + kv_off[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N] float32
        if USE_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both infinities
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        seen = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= pos[:, None])
        if USE_WINDOW:
            seen = seen & (j[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet stays at 0
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if USE_SINKS:  # the sink as one more score: rescale to the larger max, add e^(sink - max) to the sum
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_f)  # 0 for a row that saw no key
        l_i = l_i * alpha + tl.exp(sink - m_f)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if STORE_LSE:  # a row that saw no key: l_i = 0, lse = -inf (merging it is a no-op)
        lse = tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + q_rows * stride_lt + head, lse, mask=row_ok)


def block_q(max_query_len: int, group: int) -> int:
    """Query tokens per program: tl.dot wants >= 16 rows, which a decode fills with the group's heads
    (padded to a power of 2), a chunk with more tokens (64 rows). The cascade cost model counts programs
    with it."""
    block_m = 64 if max_query_len > 1 else 16
    return max(block_m // triton.next_power_of_2(group), 1)


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """The GQA group size, after the layout checks both entry points share."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1, "caches must share a layout"
    assert query.stride(2) == 1, "query's last dim must be contiguous"
    return num_heads // num_kv_heads


def _launch(grid: tuple[int, int, int], query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            out: torch.Tensor, lse: Optional[torch.Tensor], block_table: torch.Tensor, query_start_loc: torch.Tensor,
            seq_lens: torch.Tensor, bq: int, scale: float, softcap: Optional[float], window: int,
            key_start: int, key_end: int, all_queries: bool, tile_n: int,
            sinks: Optional[torch.Tensor] = None) -> None:
    group = query.shape[1] // key_cache.shape[0]
    head_dim = query.shape[2]
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == query.shape[:2] and lse.stride(1) == 1, lse.shape
        assert sinks is None, "attention sinks with an lse output"
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.shape == (query.shape[1],) and sinks.is_contiguous(), sinks.shape
    _unified_attention_kernel[grid](
        query, key_cache, value_cache, out, out if lse is None else lse, out if sinks is None else sinks, block_table,
        query_start_loc, seq_lens,
        scale, float(softcap or 0.0), int(window), int(key_start), int(key_end), query.shape[0],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        NUM_QUERIES_PER_KV=group, G_PAD=triton.next_power_of_2(group), BLOCK_Q=bq, HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=key_cache.shape[2], TILE_N=tile_n,
        USE_SOFTCAP=bool(softcap), USE_WINDOW=window > 0, ALL_QUERIES=all_queries, STORE_LSE=lse is not None,
        USE_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32")


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      max_query_len: int, scale: float, window: int = 0, softcap: Optional[float] = None,
                      out: Optional[torch.Tensor] = None, tile_n: int = 32, key_start: int = 0,
                      lse: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """query [T, H, D] -> attention output [T, H, D] (into `out` when given, any float dtype).

    key_cache/value_cache [H_kv, num_blocks, block_size, D] with equal strides; block_table
    [B, max_blocks]; query_start_loc [B + 1]; seq_lens [B] (int32 or int64, on query's device).
    `max_query_len`: the step's longest query (a host int: it sizes the grid, so no device read).
    `key_start`: keys before it are left out (cascade's suffix pass); `lse` [T, H] float32: filled
    with each row's log-sum-exp when given; `sinks` [H] float32: attention sinks (not with `lse`).
    """
    num_tokens = query.shape[0]
    group = _check(query, key_cache, value_cache)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    bq = block_q(max_query_len, group)
    grid = (num_seqs, triton.cdiv(max_query_len, bq), key_cache.shape[0])
    _launch(grid, query, key_cache, value_cache, out, lse, block_table, query_start_loc, seq_lens, bq, scale,
            softcap, window, key_start, 0, False, tile_n, sinks)
    return out


def prefix_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, prefix_len: int, scale: float, softcap: Optional[float] = None,
                     out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                     tile_n: int = 32) -> torch.Tensor:
    """Every query token of the step x keys 0..prefix_len-1 of block-table row 0, no mask -> [T, H, D].

    Cascade's prefix pass: the shared prefix read once per BLOCK_Q tokens of the whole step instead of
    once per request. `lse` [T, H] float32 as in unified_attention; prefix_len 0 gives out 0, lse -inf.
    """
    num_tokens = query.shape[0]
    group = _check(query, key_cache, value_cache)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    bq = block_q(num_tokens, group)
    grid = (1, triton.cdiv(num_tokens, bq), key_cache.shape[0])
    # query_start_loc/seq_lens are not read with ALL_QUERIES: the block table stands in for them
    _launch(grid, query, key_cache, value_cache, out, lse, block_table, block_table, block_table, bq, scale,
            softcap, 0, 0, prefix_len, True, tile_n)
    return out

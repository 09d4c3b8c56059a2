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
applies cap * tanh(score / cap) before the mask.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _unified_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr,
                              scale, softcap, window,
                              stride_qt, stride_qh, stride_ot, stride_oh,
                              stride_ch, stride_cb, stride_cs, stride_bt,
                              NUM_QUERIES_PER_KV: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # a shorter request than the step's longest
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

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
    hi = ctx + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    lo = hi * 0
    if USE_WINDOW:
        lo = tl.maximum(ctx + q_block * BLOCK_Q - window + 1, 0)
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
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      max_query_len: int, scale: float, window: int = 0, softcap: Optional[float] = None,
                      out: Optional[torch.Tensor] = None, tile_n: int = 32) -> torch.Tensor:
    """query [T, H, D] -> attention output [T, H, D] (into `out` when given).

    key_cache/value_cache [H_kv, num_blocks, block_size, D] with equal strides; block_table
    [B, max_blocks]; query_start_loc [B + 1]; seq_lens [B] (int32 or int64, on query's device).
    `max_query_len`: the step's longest query (a host int: it sizes the grid, so no device read).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1, "caches must share a layout"
    assert query.stride(2) == 1, "query's last dim must be contiguous"
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    # tl.dot wants >= 16 rows: a decode fills them with the group's heads (padded), a chunk with more tokens.
    block_m = 64 if max_query_len > 1 else 16
    block_q = max(block_m // g_pad, 1)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _unified_attention_kernel[grid](
        query, key_cache, value_cache, out, block_table, query_start_loc, seq_lens,
        scale, float(softcap or 0.0), int(window),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        NUM_QUERIES_PER_KV=group, G_PAD=g_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, TILE_N=tile_n,
        USE_SOFTCAP=bool(softcap), USE_WINDOW=window > 0,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    return out

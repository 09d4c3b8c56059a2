"""Cascade attention on the GPU: a prefix shared by every request of a step attended once for all of them.

The Triton counterpart of vlite.attention.ops.cascade (the torch reference it must match). With a
common prefix of P tokens (P / block_size leading block-table entries, the same blocks in every row,
and every query of the step after them), a step's attention splits over disjoint key sets:

    prefix  prefix_attention: all T query tokens x keys 0..P-1, one pass over the prefix per BLOCK_Q
            tokens of the whole step (the plain kernel reads it once per request and KV head)
    suffix  unified_attention(key_start=P): each request's own keys P.. with its usual causal mask
    merge   merge_attn_states: o = (e^(lse1-m) o1 + e^(lse2-m) o2) / (e^(lse1-m) + e^(lse2-m)), exact

Both passes keep float32 partial outputs and lse; the merge writes the query's dtype. No sliding
window: a window would hide part of the prefix from some queries (the backend falls back to the plain
kernel there). `use_cascade_attention` is the cost model that decides when the split pays.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from vlite.attention.ops.triton_unified_attention import block_q, prefix_attention, unified_attention

# The cost model's numbers: heuristics, to be measured on a GPU (see use_cascade_attention).
MIN_PREFIX_LEN = 256
MIN_NUM_REQS = 8
NUM_SMS = 132  # H100 SXM and H200


@triton.jit
def _merge_attn_states_kernel(o_ptr, lse_ptr, o1_ptr, lse1_ptr, o2_ptr, lse2_ptr,
                              stride_ot, stride_oh, stride_1t, stride_1h, stride_2t, stride_2h,
                              stride_lt, stride_l1t, stride_l2t,
                              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, STORE_LSE: tl.constexpr):
    """One program per (token, head): the two parts' weights from their lse, then one weighted sum."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    lse1 = tl.load(lse1_ptr + t * stride_l1t + h).to(tl.float32)
    lse2 = tl.load(lse2_ptr + t * stride_l2t + h).to(tl.float32)
    m = tl.maximum(lse1, lse2)
    m = tl.where(m == float("-inf"), 0.0, m)  # both parts empty: keep the exponents finite
    w1 = tl.exp(lse1 - m)
    w2 = tl.exp(lse2 - m)
    total = w1 + w2
    d = tl.arange(0, D_PAD)
    # An empty part (weight 0) is not read at all: its o may be unwritten memory, NaN included.
    o1 = tl.load(o1_ptr + t * stride_1t + h * stride_1h + d, mask=d < tl.where(w1 > 0.0, HEAD_DIM, 0),
                 other=0.0).to(tl.float32)
    o2 = tl.load(o2_ptr + t * stride_2t + h * stride_2h + d, mask=d < tl.where(w2 > 0.0, HEAD_DIM, 0),
                 other=0.0).to(tl.float32)
    inv = 1.0 / tl.where(total > 0.0, total, 1.0)
    out = (o1 * (w1 * inv)) + (o2 * (w2 * inv))
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    if STORE_LSE:
        safe = tl.where(total > 0.0, total, 1.0)
        tl.store(lse_ptr + t * stride_lt + h, tl.where(total > 0.0, m + tl.log(safe), float("-inf")))


def merge_attn_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                      out: Optional[torch.Tensor] = None,
                      out_lse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Two partial results over disjoint key sets -> the result over their union (cascade.merge_attn_states).

    o1/o2 [T, H, D] (last dim contiguous), lse1/lse2 [T, H] (natural log, heads contiguous). `out`
    defaults to o1's dtype; `out_lse` [T, H] float32 is written only when given (None is returned
    otherwise). A part with lse = -inf contributes nothing, whatever its o holds.
    """
    num_tokens, num_heads, head_dim = o1.shape
    assert o2.shape == o1.shape and lse1.shape == lse2.shape == (num_tokens, num_heads), (o1.shape, lse1.shape)
    assert o1.stride(2) == o2.stride(2) == 1 and lse1.stride(1) == lse2.stride(1) == 1
    if out is None:
        out = torch.empty_like(o1)
    assert out.shape == o1.shape and out.stride(2) == 1, out.shape
    if out_lse is not None:
        assert out_lse.shape == lse1.shape and out_lse.dtype == torch.float32 and out_lse.stride(1) == 1
    if num_tokens == 0 or num_heads == 0:
        return out, out_lse
    _merge_attn_states_kernel[(num_tokens, num_heads)](
        out, out if out_lse is None else out_lse, o1, lse1, o2, lse2,
        out.stride(0), out.stride(1), o1.stride(0), o1.stride(1), o2.stride(0), o2.stride(1),
        0 if out_lse is None else out_lse.stride(0), lse1.stride(0), lse2.stride(0),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), STORE_LSE=out_lse is not None)
    return out, out_lse


def cascade_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      max_query_len: int, common_prefix_len: int, scale: float, softcap: Optional[float] = None,
                      out: Optional[torch.Tensor] = None, tile_n: int = 32) -> torch.Tensor:
    """unified_attention's result (no window) for a step whose requests share their first
    `common_prefix_len` tokens: prefix pass, suffix pass, merge -> [T, H, D] (into `out` when given).

    The caller guarantees what the kernels do not check (that would read the device): common_prefix_len
    is a multiple of the block size, block-table entries 0..common_prefix_len / block_size - 1 are the
    same blocks in every row, and every query token sits at or after common_prefix_len (each request's
    context, seq_len - query_len, holds the whole prefix), so the prefix needs no causal mask.
    """
    block_size = key_cache.shape[2]
    if common_prefix_len % block_size:
        raise ValueError(f"common_prefix_len ({common_prefix_len}) must be a multiple of the block size "
                         f"({block_size})")
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return out
    parts = torch.empty(2, num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    lses = torch.empty(2, num_tokens, num_heads, dtype=torch.float32, device=query.device)
    prefix_attention(query, key_cache, value_cache, block_table, common_prefix_len, scale, softcap,
                     out=parts[0], lse=lses[0], tile_n=tile_n)
    unified_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_query_len, scale,
                      0, softcap, out=parts[1], tile_n=tile_n, key_start=common_prefix_len, lse=lses[1])
    merge_attn_states(parts[0], lses[0], parts[1], lses[1], out=out)
    return out


def use_cascade_attention(common_prefix_len: int, query_lens: Sequence[int], num_query_heads: int,
                          num_kv_heads: int, window: int, num_sms: int = NUM_SMS) -> bool:
    """Whether cascading pays for a step, by counting the programs that stream the prefix.

    Heuristics (vLLM's are in the same spirit; each number wants measuring on a GPU):
      * a sliding window: never (the prefix would not be visible to every query);
      * common_prefix_len < MIN_PREFIX_LEN (256) tokens: the prefix read is too short to outweigh the
        two extra launches and the float32 partials' round trip through memory;
      * fewer than MIN_NUM_REQS (8) requests: the plain kernel reads the prefix few times, and those
        reads run in parallel programs (the shared blocks largely hit L2);
      * else the waves: the plain kernel runs sum_r cdiv(q_r, BLOCK_Q) * H_kv programs that each stream
        the prefix, the prefix pass cdiv(T, BLOCK_Q') * H_kv (BLOCK_Q' for T rows of one sequence, as
        prefix_attention launches it). With num_sms programs at a time, each wave costs about one
        prefix stream; cascading pays when it needs fewer waves (the suffix work is the same both ways).
        One resident program per SM is the crude part: occupancy and L2 reuse move the crossover.
    """
    if window > 0 or common_prefix_len < MIN_PREFIX_LEN:
        return False
    lens = [int(n) for n in query_lens]
    if len(lens) < MIN_NUM_REQS or num_query_heads % num_kv_heads:
        return False
    group = num_query_heads // num_kv_heads
    num_tokens, max_query_len = sum(lens), max(lens)
    plain_bq = block_q(max_query_len, group)
    plain_programs = num_kv_heads * sum(triton.cdiv(n, plain_bq) for n in lens if n > 0)
    cascade_programs = num_kv_heads * triton.cdiv(num_tokens, block_q(num_tokens, group))
    return triton.cdiv(cascade_programs, num_sms) < triton.cdiv(plain_programs, num_sms)

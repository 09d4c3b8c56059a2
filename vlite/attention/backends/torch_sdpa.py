"""Paged attention for CPU in plain torch.

K/V of this step are written into the paged cache through `slot_mapping`; attention then reads
each request's K/V back through its block table. Requests are split in two groups, each run as
one batched `scaled_dot_product_attention` call:

  decodes  (query_len == 1):  q [Nd, H, 1, D]     x  K/V gathered [Nd, H_kv, Ld, D]
  prefills (query_len  > 1):  q [Np, H, Qmax, D]  x  K/V gathered [Np, H_kv, Lp, D]  (padded)

so a step mixing a long prompt chunk with many decodes does not pad every decode to the chunk.
The gather indices and masks are built once per step and shared by every layer.

    block_table row r:  [ b0 | b1 | b2 | ... ]         key position j lives in slot
    slot(j) = block_table[r, j // block_size] * block_size + j % block_size

K/V are gathered a whole block at a time (`index_select` of block_size*H_kv*D contiguous values),
about 10x faster than gathering token by token. Prefill chunks and float32 use torch's SDPA (near
the machine's matmul peak for long queries); bf16 decodes, for which CPU SDPA is slow (~4x), use a
grouped-query einsum kernel with bf16 scores and a float32 softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from vlite.profiler import section


@dataclass
class _Group:
    token_idx: torch.Tensor  # [T_g] rows of the step's flat token dimension
    pad_idx: Optional[torch.Tensor]  # [T_g] rows of the padded [N * Qmax] query buffer (prefills)
    num_reqs: int
    max_query_len: int
    block_idx: torch.Tensor  # [N * blocks] cache blocks to gather, row by row (L = blocks * block_size)
    mask: torch.Tensor  # [N, 1, Qmax, L] True = attend
    max_seq_len: int  # keys of the longest request (all of them when N == 1: no mask needed)


@dataclass
class TorchSDPAMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    decode: Optional[_Group]
    prefill: Optional[_Group]


def _build_group(rows: torch.Tensor, query_start_loc: torch.Tensor, query_lens: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> _Group:
    q_lens, s_lens = query_lens[rows], seq_lens[rows]
    n, max_q = int(rows.numel()), int(q_lens.max())
    num_blocks = -(-int(s_lens.max()) // block_size)
    block_idx = block_table[rows][:, :num_blocks].reshape(-1).long()
    j = torch.arange(num_blocks * block_size)
    ctx = (s_lens - q_lens)[:, None, None]  # tokens already in the cache before this step
    i = torch.arange(max_q)[None, :, None]
    # Causal: query i (absolute position ctx + i) sees keys 0..ctx+i. Padded query rows attend to
    # finite garbage and are dropped, which keeps softmax free of all-masked rows.
    mask = (j[None, None, :] <= ctx + i)[:, None]
    starts = query_start_loc[rows]
    token_idx = torch.repeat_interleave(starts, q_lens) + (
        torch.arange(int(q_lens.sum())) - torch.repeat_interleave(torch.cumsum(q_lens, 0) - q_lens, q_lens))
    pad_idx = None
    if max_q > 1:
        pad_idx = torch.repeat_interleave(torch.arange(n) * max_q, q_lens) + (token_idx - torch.repeat_interleave(
            starts, q_lens))
    return _Group(token_idx, pad_idx, n, max_q, block_idx, mask, int(s_lens.max()))


def build_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   slot_mapping: torch.Tensor, block_size: int) -> TorchSDPAMetadata:
    """All inputs are CPU int tensors for the scheduled requests of this step, in batch order."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = query_lens == 1
    decode_rows = torch.nonzero(is_decode).flatten()
    prefill_rows = torch.nonzero(~is_decode).flatten()
    args = (query_start_loc[:-1], query_lens, seq_lens, block_table, block_size)
    return TorchSDPAMetadata(
        num_actual_tokens=int(query_start_loc[-1]),
        slot_mapping=slot_mapping,
        decode=_build_group(decode_rows, *args) if decode_rows.numel() else None,
        prefill=_build_group(prefill_rows, *args) if prefill_rows.numel() else None,
    )


def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """Heads outermost: a request's gathered blocks are then already [H_kv, L, D] per head, the
    layout the attention matmuls want, with no transposing copy of K and V in every layer."""
    return (2, num_kv_heads, num_blocks, block_size, head_size)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, H_kv, num_blocks, block_size, D]; key/value: [T, H_kv, D]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def _attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, g: _Group,
            scale: float, whole_step: bool) -> torch.Tensor:
    """Attention output of the group's tokens, in group order [T_g, H, D].

    key_cache/value_cache: [H_kv, num_blocks, block_size, D]. `whole_step`: the group is every
    token of the step in order (an all-decode step), so no gather of its queries is needed.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[0]
    q = query if whole_step else query[g.token_idx]
    if g.pad_idx is not None:
        padded = q.new_zeros(g.num_reqs * g.max_query_len, num_heads, head_dim)
        padded[g.pad_idx] = q
        q = padded
    q = q.view(g.num_reqs, g.max_query_len, num_heads, head_dim)
    k = key_cache.index_select(1, g.block_idx).view(num_kv_heads, g.num_reqs, -1, head_dim)  # [H_kv, N, L, D]
    v = value_cache.index_select(1, g.block_idx).view(num_kv_heads, g.num_reqs, -1, head_dim)
    if g.num_reqs == 1 and g.max_query_len == 1:
        # One decode (single-stream generation): its keys exactly, no mask, float32 SDPA. For
        # bf16 this beats the grouped kernel ~2x at this size (tiny bf16 matmuls are slow here).
        k, v = k[:, :, :g.max_seq_len].transpose(0, 1), v[:, :, :g.max_seq_len].transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.float(), v.float(), scale=scale,
                                           enable_gqa=True).transpose(1, 2).to(query.dtype)
    elif query.dtype == torch.float32 or g.max_query_len > 1:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=g.mask, scale=scale, enable_gqa=True).transpose(1, 2)
    else:
        o = _grouped_attention(q, k, v, g.mask, scale)
    o = o.reshape(-1, num_heads, head_dim)
    return o if g.pad_idx is None else o[g.pad_idx]


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [N, Q, H, D], k/v [H_kv, N, L, D], mask [N, 1, Q, L] -> [N, Q, H, D].

    Each K/V head serves its H / H_kv query heads (as G * Q query rows) without being repeated.
    """
    n, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    # [H_kv, N, G * Q, D]
    qg = q.view(n, q_len, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4).reshape(
        num_kv_heads, n, group * q_len, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [H_kv, N, G * Q, L]
    scores = scores.view(num_kv_heads, n, group, q_len, -1).masked_fill_(~mask[None, :, :, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_kv_heads, n, group * q_len, -1)
    out = torch.matmul(probs, v)  # [H_kv, N, G * Q, D]
    return out.view(num_kv_heads, n, group, q_len, head_dim).permute(1, 3, 0, 2, 4).reshape(
        n, q_len, num_heads, head_dim)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: TorchSDPAMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, H_kv, D] -> [T, H, D]."""
    with section("attention"):
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        if metadata.prefill is None and metadata.decode is not None:
            return _attend(query, kv_cache[0], kv_cache[1], metadata.decode, scale, whole_step=True)
        out = torch.empty_like(query)
        for group in (metadata.decode, metadata.prefill):
            if group is not None:
                out[group.token_idx] = _attend(query, kv_cache[0], kv_cache[1], group, scale, whole_step=False)
        return out

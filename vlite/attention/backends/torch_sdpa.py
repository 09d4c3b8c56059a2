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
    kv_idx: torch.Tensor  # [N, L] cache slots to gather
    mask: torch.Tensor  # [N, 1, Qmax, L] True = attend


@dataclass
class TorchSDPAMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    decode: Optional[_Group]
    prefill: Optional[_Group]


def _build_group(rows: torch.Tensor, query_start_loc: torch.Tensor, query_lens: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> _Group:
    q_lens, s_lens = query_lens[rows], seq_lens[rows]
    n, max_q, max_l = int(rows.numel()), int(q_lens.max()), int(s_lens.max())
    j = torch.arange(max_l)
    blocks = block_table[rows][:, j // block_size].long()
    kv_idx = blocks * block_size + (j % block_size)
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
    return _Group(token_idx, pad_idx, n, max_q, kv_idx, mask)


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


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, H_kv, D]; key/value: [T, H_kv, D]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, g: _Group,
            scale: float, out: torch.Tensor) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    q = query[g.token_idx]
    if g.pad_idx is not None:
        padded = q.new_zeros(g.num_reqs * g.max_query_len, num_heads, head_dim)
        padded[g.pad_idx] = q
        q = padded
    q = q.view(g.num_reqs, g.max_query_len, num_heads, head_dim).transpose(1, 2)
    k = key_cache[g.kv_idx].transpose(1, 2)  # [N, H_kv, L, D]
    v = value_cache[g.kv_idx].transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=True)
    o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
    out[g.token_idx] = o if g.pad_idx is None else o[g.pad_idx]


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: TorchSDPAMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, H_kv, D] -> [T, H, D]."""
    with section("attention"):
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        out = torch.empty_like(query)
        for group in (metadata.decode, metadata.prefill):
            if group is not None:
                _attend(query, key_cache, value_cache, group, scale, out)
        return out

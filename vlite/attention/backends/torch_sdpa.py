"""Paged attention for CPU in plain torch.

K/V of this step are written into the paged cache through `slot_mapping`; attention then reads
each request's K/V back through its block table. Requests are split in two groups:

  decodes  (query_len == 1):  one batched call, q [Nd, H, 1, D] x K/V gathered [Nd, H_kv, Ld, D]
  prefills (query_len  > 1):  one SDPA call per request, q [1, H, Q_i, D] x its K/V [1, H_kv, L_i, D]

(with the C++ kernels, decode rows also include speculative verify chunks and a prompt's tokens below
PREFILL_DECODE_ROWS_BELOW, one row per token; prefills are then what is left of a chunk past it, and
run on the blocked prefill kernel, csrc/cpu/prefill_attention.cpp, rather than SDPA where it applies),
so a step mixing a long prompt chunk with many decodes does not pad every decode to the chunk,
and prompt chunks of different lengths are not padded to the longest (at 13 prompts of 64-256
tokens, padding more than doubled the prefill attention work). A chunk that starts its sequence
runs with `is_causal` and no mask. The gather indices and masks are built once per step and shared
by every layer of one window.

Sliding-window layers (Mistral, Gemma 2/3): the query at position p sees only the keys in
(p - window, p]. Each distinct window of the model gets its own view of the step (`for_window`):
its gathers start at the first block a query of the step still sees, so blocks that left every
window (freed by the KV cache manager for all-sliding models, their block-table entries stale or
-1) are never read. Attention-logit soft-capping (Gemma 2: scores = cap * tanh(scores / cap)) runs
on the einsum path, which computes the scores explicitly; SDPA and the C++ kernel have no such step.
Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator, no value) run on
the C++ kernels (decode, blocked prefill, cascade) where they apply, else on the einsum path (SDPA has no
such term).

    block_table row r:  [ b0 | b1 | b2 | ... ]         key position j lives in slot
    slot(j) = block_table[r, j // block_size] * block_size + j % block_size

K/V are gathered a whole block at a time (`index_select` of block_size*H_kv*D contiguous values),
about 10x faster than gathering token by token. Prefill chunks and float32 use torch's SDPA (near
the machine's matmul peak for long queries); bf16 decodes, for which CPU SDPA is slow (~4x), use a
grouped-query einsum kernel with bf16 scores and a float32 softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from vlite.attention.backends import cpu_decode_attention
from vlite.profiler import section
from vlite.utils import group_offsets

# The C++ kernels module (vlite._custom_ops, through cpu_decode_attention), or None: set by load_kernels()
# at engine start.
_decode_kernel = None


# Prompt tokens at positions below this run as decode rows through the C++ kernel (each row its own
# causal keys), not as SDPA prefill chunks: a token's attention output is then the same bits however
# its prompt was cut into chunks, and the same as a decode or speculative verify row at its position.
# SDPA's bits depend on the chunk boundaries (its GEMM tiles treat a chunk's last rows apart); with
# bf16 activations quantized to int8 those last-bit differences change greedy outputs (6 of 12 chat
# prompts prefilled in 64-token chunks vs in one), so a batch's composition, the step budget or
# speculative drafts taking part of it changed what a request generated. Past this position the
# blocked prefill kernel (csrc/cpu/prefill_attention.cpp) takes a chunk's rows: each 256-key chunk laid
# out once for a group of rows, ~550 GFLOP/s in bf16 on 2 Zen 4 cores against SDPA's ~130 (per layer,
# a 2,024-token prompt of SmolLM2-135M: 34 -> 11 ms). Its rows are chunk-invariant as well (except in a
# one-row chunk, which is a decode row), but not the same bits as a decode row at their position, so the
# rows below stay on the decode kernel. SDPA remains for soft-capped and windowed layers.
PREFILL_DECODE_ROWS_BELOW = 1024


def prefill_decode_rows_below(dtype: torch.dtype, head_dim: int, softcap: Optional[float]) -> int:
    """PREFILL_DECODE_ROWS_BELOW for a model whose attention the C++ kernel takes (its dtype and head
    size, no logit soft-capping: that runs on the torch path), else 0 (build_metadata's
    `decode_rows_below`)."""
    return PREFILL_DECODE_ROWS_BELOW if softcap is None and cpu_decode_attention.supports(dtype, head_dim) else 0


# Cascade attention (csrc/cpu/cascade_attention.cpp) where a step's rows share a prefix of at least
# CASCADE_MIN_PREFIX tokens, its query vectors per kv head (rows x query heads per kv head) number at
# least CASCADE_MIN_VECTORS (head size 64; 16 for larger heads, whose plain kernel gains less from its
# own query heads), and no request's chunk is longer than CASCADE_MAX_QUERY_LEN (every token of the step
# then runs as a decode row: a long prompt chunk is faster on SDPA). The cascade's fixed cost is laying
# out each prefix chunk's keys and values for all rows; its gain, fewer operations per score. Measured,
# cascade vs plain kernel per layer at 2,000 shared tokens, one thread (`vlite bench` figures in
# docs/benchmarks.md): 9/3 heads of 64 (SmolLM2-135M) bf16 AVX-512 8 rows 0.88x, 12 0.97-1.07x, 16
# 1.08x, 32 1.25-1.31x, 96 1.38x; AVX2 8 rows 0.94x, 32 1.27x; 32/8 heads of 64 (Llama 3.2 1B) 8 rows
# 0.93x, 16 1.13x; 24/8 heads of 128 (3B) 8 rows 1.18x, 16 1.48x; 8/8 of 128, 32 rows 1.74x.
CASCADE_MIN_PREFIX = 256
CASCADE_MIN_VECTORS = 48
CASCADE_MAX_QUERY_LEN = 256


def supports_cascade(dtype: torch.dtype, head_dim: int, softcap: Optional[float]) -> bool:
    """Whether the cascade kernel, and the blocked prefill kernel over its prefix unit, take a model's attention
    (the C++ kernels' dtypes; head sizes 64, 128, 256; no soft-capping)."""
    return prefill_decode_rows_below(dtype, head_dim, softcap) > 0 and head_dim in (64, 128, 256)


def use_cascade_attention(common_prefix_len: int, query_lens: Union[np.ndarray, Sequence[int]],
                          num_query_heads: int, num_kv_heads: int, window: int, head_dim: int = 64) -> bool:
    """Whether a step whose requests share their first `common_prefix_len` tokens runs faster with the
    prefix attended once for all its rows (the thresholds above; no sliding window, C++ kernels loaded)."""
    if window or _decode_kernel is None or common_prefix_len < CASCADE_MIN_PREFIX:
        return False
    lens = np.asarray(query_lens)
    vectors = int(lens.sum()) * (num_query_heads // num_kv_heads)
    return vectors >= (CASCADE_MIN_VECTORS if head_dim <= 64 else 16) and int(lens.max()) <= CASCADE_MAX_QUERY_LEN


def load_kernels() -> None:
    """Compile/load the optional C++ decode kernel now rather than in the first step."""
    global _decode_kernel
    _decode_kernel = cpu_decode_attention.load()


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor  # [N] rows of the step's flat token dimension
    num_reqs: int
    block_table: torch.Tensor  # [N, max_blocks] int64, for the C++ kernel
    seq_lens: torch.Tensor  # [N] int64
    block_size: int
    window: int
    # > 0: every row's first that many blocks are the same ones, attended once for all rows (cascade)
    num_prefix_blocks: int = 0

    # The torch path's gather plan, built on first use: the C++ kernel reads the block table itself,
    # and building the plan costs ~0.1 ms per step.
    @cached_property
    def _gather(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        s_lens, bs = self.seq_lens, self.block_size
        first_key = _first_keys(s_lens - 1, self.window)
        first_block, last_block = first_key // bs, (s_lens - 1) // bs
        num_blocks = int((last_block - first_block).max()) + 1
        # Each row gathers its own blocks from its window's first one; rows needing fewer repeat their
        # last block (masked), so no row reads a block it does not hold.
        logical = torch.minimum(first_block[:, None] + torch.arange(num_blocks)[None, :], last_block[:, None])
        block_idx = self.block_table.gather(1, logical).reshape(-1)
        key_pos = first_block[:, None] * bs + torch.arange(num_blocks * bs)[None, :]
        mask = ((key_pos < s_lens[:, None]) & (key_pos >= first_key[:, None]))[:, None, None, :]
        offset = int(first_block[0]) * bs
        return block_idx, mask, (int(first_key[0]) - offset, int(s_lens[0]) - offset)

    @property
    def block_idx(self) -> torch.Tensor:
        """[N * blocks] cache blocks to gather, row by row (L = blocks * block_size)."""
        return self._gather[0]

    @property
    def mask(self) -> torch.Tensor:
        """[N, 1, 1, L] True = attend (a request's own keys, within its window)."""
        return self._gather[1]

    @property
    def key_range(self) -> tuple[int, int]:
        """N == 1: the gathered keys it attends to, [lo, hi) (no mask needed)."""
        return self._gather[2]


@dataclass
class _PrefillChunk:
    start: int  # first row in the step's flat token dimension
    query_len: int
    num_keys: int  # keys gathered: from the first block a query of the chunk sees to the chunk's end
    block_ids: torch.Tensor  # those cache blocks, in order
    mask: Optional[torch.Tensor]  # [Q, L] causal (and windowed), bottom-right aligned; None: plain causal


@dataclass
class TorchSDPAMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    decode: Optional[_DecodeGroup]
    prefills: list[_PrefillChunk]
    window: int = 0  # the keys each query of this view sees: 0 = all before it, w = its last w
    # The same step seen by the model's layers of other windows (Gemma 3: global and sliding layers).
    others: dict[int, TorchSDPAMetadata] = field(default_factory=dict)
    # For the step's linear layers rather than attention: the row count that decides the quantized
    # kernels' float32 residual row (vlite.layers.quantization.linear); None: each call's own rows.
    precise_rows: Optional[int] = None
    # Linear-attention layers' view of the step (vlite.attention.backends.gdn_attn), set by the runner for
    # models that have them; None otherwise.
    gdn: Optional[Any] = None
    # KV cache groups past the first (sliding and full layers in separate groups): layer index -> the step's view
    # through that layer's group's block table and slots; layers not in it read this one.
    layer_views: dict[int, TorchSDPAMetadata] = field(default_factory=dict)

    def for_window(self, window: int) -> TorchSDPAMetadata:
        """The view of the step that layers attending through `window` read."""
        return self if window == self.window else self.others[window]


def _first_keys(query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """The first key position a query at `query_pos` sees: 0, or query_pos - window + 1."""
    return (query_pos - window + 1).clamp(min=0) if window else torch.zeros_like(query_pos)


def _build_decode_group(rows: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, block_size: int, window: int) -> _DecodeGroup:
    return _DecodeGroup(query_start_loc[rows], int(rows.numel()), block_table[rows].long(), seq_lens[rows].long(),
                        block_size, window)


def _build_prefill_chunks(rows: torch.Tensor, query_start_loc: torch.Tensor, query_lens: torch.Tensor,
                          seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                          window: int) -> list[_PrefillChunk]:
    chunks = []
    for row, start, q_len, s_len in zip(rows.tolist(), query_start_loc[rows].tolist(), query_lens[rows].tolist(),
                                        seq_lens[rows].tolist()):
        ctx = s_len - q_len  # tokens already in the cache: query i (position ctx + i) sees keys 0..ctx+i
        first_block = (max(0, ctx - window + 1) if window else 0) // block_size
        offset = first_block * block_size
        mask = None
        if ctx > 0 or (window and q_len > window):  # else plain causal: every key is in the window
            key_pos = torch.arange(offset, s_len)[None, :]
            query_pos = ctx + torch.arange(q_len)[:, None]
            mask = key_pos <= query_pos
            if window:
                mask &= key_pos > query_pos - window
        block_ids = block_table[row, first_block:-(-s_len // block_size)].long()
        chunks.append(_PrefillChunk(start, q_len, s_len - offset, block_ids, mask))
    return chunks


def build_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   slot_mapping: torch.Tensor, block_size: int, windows: Sequence[int] = (0,),
                   max_decode_query_len: Union[int, torch.Tensor] = 1,
                   decode_rows_below: int = 0, max_query_len: Optional[int] = None,
                   precise_rows: Optional[int] = None, common_prefix_len: int = 0) -> TorchSDPAMetadata:
    """All inputs are CPU int tensors for the scheduled requests of this step, in batch order.

    `windows`: the distinct attention windows of the model's layers (0: full causal attention); one
    view of the step is built per window, the first one returned with the others in `others`.
    `max_decode_query_len` > 1 (speculative decoding; an int, or one per request): a request's chunk of up
    to that many tokens runs as that many decode rows, query i seeing the keys up to its own position
    (causal), since every K/V of the step is written before any query reads. The runner gives each
    request 1 + its drafts, so a short prompt chunk stays a prefill, computed as without speculation.
    `decode_rows_below` > 0 (with the C++ kernel loaded): the tokens of a prompt chunk at positions below
    it run as decode rows too (see PREFILL_DECODE_ROWS_BELOW).
    `max_query_len` (the host's figure, optional) at most an int `max_decode_query_len`: every token is a
    decode row (a decode step, or one verifying drafts), built without the ~15 small tensor ops that
    sort rows into decodes and prefill chunks (~60 us of a ~5 ms single-stream step, ~200 us with drafts).
    `precise_rows`: see TorchSDPAMetadata (a verify step's rows less its drafts: every request's rows are then
    computed as without speculation).
    `common_prefix_len` > 0 (the runner's use_cascade_attention said so): every request's first that many
    tokens are the same blocks, computed before this step; every token of the step runs as a decode row and
    the layers without a window attend the prefix once for all of them (cascade attention).
    """
    if common_prefix_len:
        if common_prefix_len % block_size or common_prefix_len < 0:
            raise ValueError(f"common_prefix_len ({common_prefix_len}) must be a non-negative multiple of "
                             f"block_size ({block_size})")
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        m = build_metadata(query_start_loc, seq_lens, block_table, slot_mapping, block_size, windows, max_query_len,
                           0, max_query_len, precise_rows)
        for view in (m, *m.others.values()):
            if view.window == 0:
                view.decode.num_prefix_blocks = common_prefix_len // block_size
        return m
    if max_query_len is not None and isinstance(max_decode_query_len, int) and max_query_len <= max_decode_query_len:
        starts = query_start_loc[:-1]
        if max_query_len > 1:  # verify chunks: one decode row per token
            num_reqs = seq_lens.numel()
            starts, seq_lens, block_table = _token_rows(np.arange(num_reqs), np.diff(query_start_loc.numpy()),
                                                        query_start_loc, seq_lens, block_table)
        num_rows = seq_lens.numel()
        return _one_view_per_window(windows, lambda window: TorchSDPAMetadata(
            num_actual_tokens=num_rows, slot_mapping=slot_mapping,
            decode=_DecodeGroup(starts, num_rows, block_table.long(), seq_lens.long(), block_size, window),
            prefills=[], window=window, precise_rows=precise_rows))
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = query_lens <= max_decode_query_len
    # Each request's first `num_decode` tokens of the step are decode rows, the rest one prefill chunk.
    num_decode = torch.where(is_decode, query_lens, 0)
    if decode_rows_below > 0 and _decode_kernel is not None and not bool(is_decode.all()):
        context = seq_lens - query_lens
        num_decode = torch.where(is_decode, query_lens, (decode_rows_below - context).clamp(0).minimum(query_lens))
    decode_rows = torch.nonzero(num_decode).flatten()
    prefill_rows = torch.nonzero(num_decode < query_lens).flatten()
    if decode_rows.numel() and bool((num_decode[decode_rows] > 1).any()):
        decode_starts, decode_seq_lens, decode_table = _token_rows(
            decode_rows.numpy(), num_decode[decode_rows].numpy(), query_start_loc, seq_lens, block_table)
        decode_rows = torch.arange(decode_starts.numel())
    else:
        decode_starts, decode_seq_lens, decode_table = query_start_loc[:-1], seq_lens, block_table
    # a chunk's prefill part starts after its decode rows
    prefill_starts, prefill_lens = query_start_loc[:-1] + num_decode, query_lens - num_decode
    return _one_view_per_window(windows, lambda window: TorchSDPAMetadata(
        num_actual_tokens=int(query_start_loc[-1]),
        slot_mapping=slot_mapping,
        decode=(_build_decode_group(decode_rows, decode_starts, decode_seq_lens, decode_table, block_size, window)
                if decode_rows.numel() else None),
        prefills=_build_prefill_chunks(prefill_rows, prefill_starts, prefill_lens, seq_lens, block_table,
                                       block_size, window),
        window=window, precise_rows=precise_rows))


def _token_rows(rows: np.ndarray, counts: np.ndarray, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first counts[i] tokens of request rows[i] as decode rows of one token each, seeing the keys up to
    its own position: per row, its index in the step, the seq_len it sees, its request's block table row.
    In numpy: a verify step's ~8 small tensor ops cost more than the rest of its metadata."""
    qsl, owner = query_start_loc.numpy(), np.repeat(rows, counts)
    within = group_offsets(counts)
    row_seq_lens = seq_lens.numpy()[owner] - (qsl[owner + 1] - qsl[owner]) + 1 + within
    return torch.from_numpy(qsl[owner] + within), torch.from_numpy(row_seq_lens), block_table[torch.from_numpy(owner)]


def _one_view_per_window(windows: Sequence[int], view: Callable[[int], TorchSDPAMetadata]) -> TorchSDPAMetadata:
    """The step's view for each distinct window, the first one holding the others."""
    views = [view(window) for window in dict.fromkeys(windows)]
    views[0].others = {v.window: v for v in views[1:]}
    return views[0]


def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """Heads outermost: a request's gathered blocks are then already [H_kv, L, D] per head, the
    layout the attention matmuls want, with no transposing copy of K and V in every layer."""
    return (2, num_kv_heads, num_blocks, block_size, head_size)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, H_kv, num_blocks, block_size, D]; key/value: [T, H_kv, D]."""
    if _decode_kernel is not None and key.stride(2) == 1 and value.stride(2) == 1:  # one C++ call (a plain copy)
        _decode_kernel.write_kv_cache(key, value, kv_cache, slot_mapping)
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def _attend_decodes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, g: _DecodeGroup,
                    scale: float, whole_step: bool, window: int = 0, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention output of the group's one-token queries, in group order [N, H, D].

    key_cache/value_cache: [H_kv, num_blocks, block_size, D]. `whole_step`: the group is every
    token of the step in order (an all-decode step), so no gather of its queries is needed.
    `sinks`: float32 [H], each query head's attention sink (None: none).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[0]
    if _decode_kernel is not None and softcap is None and cpu_decode_attention.can_run(query):
        return _decode_kernel.paged_decode_attention(query if whole_step else query[g.token_idx], key_cache,
                                                     value_cache, g.block_table, g.seq_lens, scale, window,
                                                     g.num_prefix_blocks, sinks)
    q = (query if whole_step else query[g.token_idx]).view(g.num_reqs, 1, num_heads, head_dim)
    k = key_cache.index_select(1, g.block_idx).view(num_kv_heads, g.num_reqs, -1, head_dim)  # [H_kv, N, L, D]
    v = value_cache.index_select(1, g.block_idx).view(num_kv_heads, g.num_reqs, -1, head_dim)
    if softcap is not None or sinks is not None:
        o = _grouped_attention(q, k, v, g.mask, scale, softcap, sinks)
    elif g.num_reqs == 1:
        # One decode (single-stream generation): its keys exactly, no mask, float32 SDPA. For
        # bf16 this beats the grouped kernel ~2x at this size (tiny bf16 matmuls are slow here).
        lo, hi = g.key_range
        k, v = k[:, :, lo:hi].transpose(0, 1), v[:, :, lo:hi].transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.float(), v.float(), scale=scale,
                                           enable_gqa=True).transpose(1, 2).to(query.dtype)
    elif query.dtype == torch.float32:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=g.mask, scale=scale, enable_gqa=True).transpose(1, 2)
    else:
        o = _grouped_attention(q, k, v, g.mask, scale)
    return o.reshape(-1, num_heads, head_dim)


def _attend_prefills(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     chunks: list[_PrefillChunk], scale: float, out: torch.Tensor,
                     softcap: Optional[float] = None, window: int = 0, sinks: Optional[torch.Tensor] = None) -> None:
    """Each prompt chunk against its own keys (no padding), written into `out` at its token rows."""
    num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[-1]
    blocked = _decode_kernel is not None and not window and supports_cascade(query.dtype, head_dim, softcap)
    for c in chunks:
        if blocked:  # window 0: the chunk's blocks start at the sequence's first
            rows = slice(c.start, c.start + c.query_len)
            out[rows] = _decode_kernel.prefill_attention(query[rows].contiguous(), key_cache, value_cache, c.block_ids,
                                                         c.num_keys - c.query_len, scale, sinks)
            continue
        k = key_cache.index_select(1, c.block_ids).view(num_kv_heads, -1, head_dim)[:, :c.num_keys]
        v = value_cache.index_select(1, c.block_ids).view(num_kv_heads, -1, head_dim)[:, :c.num_keys]
        rows = slice(c.start, c.start + c.query_len)
        if softcap is not None or sinks is not None:
            mask = c.mask if c.mask is not None else torch.ones(c.query_len, c.num_keys, dtype=torch.bool).tril(
                c.num_keys - c.query_len)
            out[rows] = _grouped_attention(query[rows][None], k[:, None], v[:, None], mask[None, None], scale,
                                           softcap, sinks)[0]
            continue
        q = query[rows].transpose(0, 1)[None]  # [1, H, Q, D]
        o = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=c.mask, is_causal=c.mask is None,
                                           scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float, softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
                       ) -> torch.Tensor:
    """q [N, Q, H, D], k/v [H_kv, N, L, D], mask [N, 1, Q, L] -> [N, Q, H, D].

    Each K/V head serves its H / H_kv query heads (as G * Q query rows) without being repeated.
    `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2). `sinks` [H]: each
    query head's sink joins its softmax as one more column, dropped after (transformers' gpt-oss eager path).
    """
    n, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    # [H_kv, N, G * Q, D]
    qg = q.view(n, q_len, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4).reshape(
        num_kv_heads, n, group * q_len, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [H_kv, N, G * Q, L]
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(num_kv_heads, n, group, q_len, -1).masked_fill_(~mask[None, :, :, :, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(num_kv_heads, 1, group, 1, 1).expand(-1, n, -1, q_len, 1)
        scores = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = scores.to(v.dtype).reshape(num_kv_heads, n, group * q_len, -1)
    else:
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_kv_heads, n, group * q_len, -1)
    out = torch.matmul(probs, v)  # [H_kv, N, G * Q, D]
    return out.view(num_kv_heads, n, group, q_len, head_dim).permute(1, 3, 0, 2, 4).reshape(
        n, q_len, num_heads, head_dim)


def paged_attention(query: torch.Tensor, key: Optional[torch.Tensor], value: Optional[torch.Tensor],
                    kv_cache: torch.Tensor, metadata: TorchSDPAMetadata, scale: float, window: int = 0,
                    softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """query [T, H, D], key/value [T, H_kv, D] -> [T, H, D].

    `window` > 0: each query sees only its last `window` keys (the metadata must have been built
    with that window); `softcap`: attention-logit soft-capping; `sinks`: float32 [H] attention sinks.
    key/value None: the step's K/V are in the cache already (a KV-shared layer reads another layer's).
    """
    with section("attention"):
        if key is not None:
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        m = metadata.for_window(window)
        if not m.prefills and m.decode is not None:
            return _attend_decodes(query, kv_cache[0], kv_cache[1], m.decode, scale, True, window, softcap, sinks)
        out = torch.empty_like(query)
        if m.decode is not None:
            out[m.decode.token_idx] = _attend_decodes(query, kv_cache[0], kv_cache[1], m.decode, scale, False,
                                                      window, softcap, sinks)
        _attend_prefills(query, kv_cache[0], kv_cache[1], m.prefills, scale, out, softcap, window, sinks)
        return out

"""Paged attention on CUDA with vlite's Triton kernels: one launch writes the step's K/V, one
attends for every request of the step (prefill chunks and decodes together).

It reads the same runner inputs and the same KV cache layout as the CPU backend (torch_sdpa), so
the runner feeds both alike; unlike it, the metadata is only the device tensors themselves (the
kernel derives masks and windows per program), which also makes it fit for CUDA-graph capture:
a captured step's metadata points at static buffers that each replay refills.

Cascade attention: when the runner finds the step's requests sharing their first blocks (a system
prompt found by prefix caching) and `use_cascade_attention` says it pays, it passes the shared length as
build_metadata's common_prefix_len, and the layers without a sliding window attend that prefix once for
the whole step (vlite.attention.ops.triton_cascade); windowed layers keep the plain kernel. The length
is a host int that picks other launches, so cascade steps are not CUDA-graph captured: the graphs hold
the plain path (CUDAGraphRunner builds its metadata with common_prefix_len 0 and padded_size turns
cascade steps away).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from vlite.attention.backends.torch_sdpa import get_kv_cache_shape
from vlite.attention.ops.triton_cascade import cascade_attention, use_cascade_attention
from vlite.attention.ops.triton_reshape_and_cache import reshape_and_cache
from vlite.attention.ops.triton_unified_attention import unified_attention
from vlite.profiler import section

__all__ = ["TritonAttentionBackend", "TritonAttentionMetadata", "get_kv_cache_shape"]


@dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written; < 0: a padded row, not written
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, max_blocks]
    max_query_len: int  # sizes the kernel's grid (host int: no device read)
    precise_rows: Optional[int] = None  # the CPU kernels' (TorchSDPAMetadata's); the layers pass it on
    common_prefix_len: int = 0  # tokens every request shares (a multiple of block_size): > 0 cascades

    def for_window(self, window: int) -> TritonAttentionMetadata:
        """Every window reads the same metadata: the kernel applies the window itself."""
        return self

    def paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        scale: float, window: int = 0, softcap: Optional[float] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, H_kv, D] -> [T, H, D] (the CPU backend's contract); the cascade
        split when the step has a common prefix and this layer no window nor attention sinks (the plain kernel
        adds those: the same attention, the prefix read once per request)."""
        with section("attention"):
            if key is not None:  # None: a KV-shared layer, its K/V written by the layer it reads
                reshape_and_cache(key, value, kv_cache, self.slot_mapping)
            if self.common_prefix_len > 0 and window == 0 and sinks is None:
                return cascade_attention(query, kv_cache[0], kv_cache[1], self.block_table, self.query_start_loc,
                                         self.seq_lens, self.max_query_len, self.common_prefix_len, scale, softcap)
            return unified_attention(query, kv_cache[0], kv_cache[1], self.block_table, self.query_start_loc,
                                     self.seq_lens, self.max_query_len, scale, window, softcap, sinks=sinks)


class TritonAttentionBackend:
    """The backend interface the runner uses (see vlite.attention.selector)."""

    name = "TRITON_ATTN"
    get_kv_cache_shape = staticmethod(get_kv_cache_shape)

    @staticmethod
    def prefill_decode_rows_below(dtype: torch.dtype, head_dim: int, softcap: Optional[float]) -> int:
        """The CPU backend's prompt tokens as decode rows: not used here."""
        return 0

    @staticmethod
    def load_kernels() -> None:
        """Nothing to load ahead: Triton compiles each kernel variant at its first launch."""

    @staticmethod
    def build_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       slot_mapping: torch.Tensor, block_size: int, windows: Sequence[int] = (0,),
                       max_query_len: Optional[int] = None, max_decode_query_len: int = 1,
                       decode_rows_below: int = 0, precise_rows: Optional[int] = None,
                       common_prefix_len: int = 0) -> TritonAttentionMetadata:
        """The inputs on the device already; `max_query_len` from the host (None: read back, a sync).
        `decode_rows_below` (the CPU backend's prompt tokens as decode rows) does not apply here.

        `common_prefix_len`: tokens at the start of every request that are the same blocks in every
        block-table row and lie before every query token of the step (each context holds them), a
        multiple of block_size, as the runner decided with use_cascade_attention; 0 = the plain kernel."""
        if common_prefix_len < 0 or common_prefix_len % block_size:
            raise ValueError(f"common_prefix_len ({common_prefix_len}) must be a non-negative multiple of "
                             f"block_size ({block_size})")
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        return TritonAttentionMetadata(int(slot_mapping.shape[0]), slot_mapping, query_start_loc, seq_lens,
                                       block_table, max_query_len, precise_rows, common_prefix_len)

    @staticmethod
    def supports_cascade(dtype: torch.dtype, head_dim: int, softcap: Optional[float]) -> bool:
        """The Triton kernels cascade any head size, dtype and soft-capping."""
        return True

    @staticmethod
    def use_cascade_attention(common_prefix_len: int, query_lens: Union[np.ndarray, Sequence[int]],
                              num_query_heads: int, num_kv_heads: int, window: int, head_dim: int = 128) -> bool:
        """Whether cascading a step with this common prefix pays (triton_cascade.use_cascade_attention's
        cost model: prefix >= 256 tokens, >= 8 requests, no sliding window, fewer waves of programs)."""
        return use_cascade_attention(common_prefix_len, query_lens, num_query_heads, num_kv_heads, window)

"""The C++ paged-attention kernel for decode tokens (vlite/csrc/cpu/decode_attention.cpp).

The torch path (`torch_sdpa._attend_decodes`) gathers every decode request's K/V blocks into a
copy padded to the longest request, then runs batched matmuls. The kernel instead walks each
(request, KV head) pair's own blocks: scores, softmax and the output accumulator in float32 vector
registers (AVX-512, AVX2 or portable C++: vlite._custom_ops picks the build), the pairs spread over
torch's intra-op threads. Measured on the 2-core dev machine (bf16, ~250-token contexts, per
layer): 1 decode 53 -> 13 us, 8 decodes 199 -> 126 us, 32 decodes 725 -> 529 us.

    for each (request n, kv head h), in parallel:
        s_g,j = (q[n, h*G + g] * scale) . K[h, block_table[n, j // B], j % B]    g < G, j < seq_len
        out[n, h*G + g] = softmax_j(s_g) @ V[h, block(j), j % B]
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from vlite import _custom_ops


def load() -> Optional[Any]:
    """The kernel module (`module.paged_decode_attention(query [N, H, D], key_cache, value_cache
    [H_kv, num_blocks, block_size, D], block_table [N, max_blocks] int64, seq_lens [N] int64,
    scale, window=0) -> [N, H, D]`; window > 0: each query reads only its last `window` keys, so
    blocks behind them are never touched), or None where the C++ kernels are unavailable: use the
    torch path."""
    return _custom_ops.load()


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Dtypes and head sizes the kernel handles (head_dim a multiple of 16, at most 256)."""
    return dtype in (torch.bfloat16, torch.float32) and head_dim % 16 == 0 and head_dim <= 256


def can_run(query: torch.Tensor) -> bool:
    return supports(query.dtype, query.shape[-1])

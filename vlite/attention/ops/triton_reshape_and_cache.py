"""Write this step's K/V into the paged cache through `slot_mapping`, in one Triton launch.

The cache layout is the CPU backend's (vlite.attention.backends.torch_sdpa.get_kv_cache_shape):

    kv_cache [2, H_kv, num_blocks, block_size, D]      slot s = block * block_size + offset
    key/value [T, H_kv, D]  ->  kv_cache[0|1, h, s // block_size, s % block_size, :]

A negative slot skips the token: the padded rows of a CUDA-graph step write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_ckv, stride_ch, stride_cb, stride_cs,
                              BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=dmask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=dmask)
    dst = head.to(tl.int64) * stride_ch + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + d
    tl.store(cache_ptr + dst, k, mask=dmask)
    tl.store(cache_ptr + stride_ckv + dst, v, mask=dmask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key/value [T, H_kv, D] (last dim contiguous) -> kv_cache [2, H_kv, num_blocks, block_size, D]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1, "last dims must be contiguous"
    assert kv_cache.shape[1] == num_kv_heads and kv_cache.shape[4] == head_dim, "cache does not match K/V"
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[3], HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim))

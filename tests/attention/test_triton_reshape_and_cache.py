"""The Triton K/V cache write against the CPU backend's torch write: same layout, same slots;
a negative slot (a padded row of a CUDA-graph step) writes nothing."""

from __future__ import annotations

import pytest
import torch

from vlite.attention.backends.torch_sdpa import get_kv_cache_shape


@pytest.mark.parametrize("block_size,head_dim,dtype", [(16, 16, torch.float32), (32, 24, torch.float16)])
def test_matches_torch_write(triton_device, block_size, head_dim, dtype):
    from vlite.attention.ops.triton_reshape_and_cache import reshape_and_cache

    torch.manual_seed(0)
    num_tokens, num_kv_heads, num_blocks = 7, 2, 5
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype)
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads:2 * num_kv_heads]  # strided, as the layer passes
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1
    cache = torch.full(get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype)
    expected = cache.clone()
    keep = slots >= 0
    expected[0].view(num_kv_heads, -1, head_dim)[:, slots[keep]] = key[keep].transpose(0, 1)
    expected[1].view(num_kv_heads, -1, head_dim)[:, slots[keep]] = value[keep].transpose(0, 1)

    dev = triton_device
    got = cache.to(dev)
    reshape_and_cache(key.to(dev), value.to(dev), got, slots.to(dev))
    assert torch.equal(got.cpu(), expected)

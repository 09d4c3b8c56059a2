"""The CPU backend's cascade path: build_metadata(common_prefix_len) runs every token of the step as a
decode row with the shared blocks attended once (layers without a window), paged_attention then equals
the plain step; use_cascade_attention's thresholds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlite import _custom_ops
from vlite.attention.backends import torch_sdpa
from vlite.attention.backends.torch_sdpa import build_metadata, get_kv_cache_shape, paged_attention

H, H_KV, D, BS = 8, 2, 64, 16


@pytest.fixture(autouse=True)
def kernel(monkeypatch):
    ops = _custom_ops.load()
    if ops is None:
        pytest.skip("no C++ kernels")
    monkeypatch.setattr(torch_sdpa, "_decode_kernel", ops)


def _step(prefix_blocks: int, query_lens: list[int], own_context: list[int], seed: int = 0):
    """Requests sharing blocks 0..prefix_blocks-1 of a cache, each with `own_context` cached tokens of its
    own after them and `query_lens` new ones; returns the step's tensors and a filled cache."""
    g = torch.Generator().manual_seed(seed)
    n = len(query_lens)
    seq_lens = torch.tensor([prefix_blocks * BS + c + q for c, q in zip(own_context, query_lens)])
    width = int(seq_lens.max()) // BS + 2
    num_blocks = prefix_blocks + n * width + 1
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(n, width, dtype=torch.int32)
    table[:, :prefix_blocks] = perm[:prefix_blocks]
    table[:, prefix_blocks:] = perm[prefix_blocks:prefix_blocks + n * (width - prefix_blocks)].view(n, -1)
    kv = torch.randn(get_kv_cache_shape(num_blocks, BS, H_KV, D), generator=g)
    qsl = torch.zeros(n + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    t = int(qsl[-1])
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens.tolist(), query_lens)])
    owner = torch.repeat_interleave(torch.arange(n), torch.tensor(query_lens))
    slots = table[owner, positions // BS].long() * BS + positions % BS
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (H, H_KV, H_KV))
    return qsl, seq_lens, table, slots, kv, q, k, v


@pytest.mark.parametrize("query_lens,own", [([1] * 9, [0, 3, 17, 40, 1, 0, 2, 5, 9]), ([1, 24, 3, 1, 7], [5, 0, 40, 2, 0])])
def test_cascade_step_equals_plain(query_lens, own):
    qsl, seq_lens, table, slots, kv, q, k, v = _step(20, query_lens, own)
    plain_md = build_metadata(qsl, seq_lens, table, slots, BS, (0, 32))
    casc_md = build_metadata(qsl, seq_lens, table, slots, BS, (0, 32), common_prefix_len=20 * BS)
    assert not casc_md.prefills
    assert casc_md.decode.num_reqs == sum(query_lens) and casc_md.decode.num_prefix_blocks == 20
    assert casc_md.for_window(32).decode.num_prefix_blocks == 0  # a window hides part of the prefix
    plain = paged_attention(q, k, v, kv.clone(), plain_md, D ** -0.5)
    cascade = paged_attention(q, k, v, kv.clone(), casc_md, D ** -0.5)
    torch.testing.assert_close(cascade, plain, rtol=1e-5, atol=2e-6)
    windowed = paged_attention(q, k, v, kv.clone(), casc_md, D ** -0.5, window=32)
    torch.testing.assert_close(windowed, paged_attention(q, k, v, kv.clone(), plain_md, D ** -0.5, window=32),
                               rtol=1e-5, atol=2e-6)


def test_common_prefix_len_must_be_whole_blocks():
    qsl, seq_lens, table, slots, *_ = _step(4, [1, 1], [0, 0])
    with pytest.raises(ValueError, match="common_prefix_len"):
        build_metadata(qsl, seq_lens, table, slots, BS, common_prefix_len=BS + 1)


def test_use_cascade_attention_thresholds(monkeypatch):
    use = torch_sdpa.use_cascade_attention
    rows = np.ones(torch_sdpa.CASCADE_MIN_VECTORS // 3, dtype=np.int64)  # x 3 query heads per kv head
    assert use(torch_sdpa.CASCADE_MIN_PREFIX, rows, 9, 3, 0)
    assert not use(torch_sdpa.CASCADE_MIN_PREFIX - BS, rows, 9, 3, 0)  # too short a prefix
    assert not use(2000, rows[1:], 9, 3, 0)  # too few rows
    assert use(2000, rows[:6], 9, 3, 0, head_dim=128)  # larger heads: fewer rows pay
    assert not use(2000, rows[1:], 12, 12, 0)  # no grouped query heads: each row one vector per kv head
    assert use(2000, [len(rows) // 2] * 2, 9, 3, 0)  # rows are tokens: two chunks of 8 are 16 rows
    assert not use(2000, [1] * 16 + [torch_sdpa.CASCADE_MAX_QUERY_LEN + 1], 9, 3, 0)  # a long prompt chunk
    assert not use(2000, rows, 9, 3, 4096)  # a sliding window
    monkeypatch.setattr(torch_sdpa, "_decode_kernel", None)
    assert not use(2000, rows, 9, 3, 0)  # the torch path has no cascade
    assert torch_sdpa.supports_cascade(torch.bfloat16, 64, None) == (_custom_ops.load() is not None)
    assert not torch_sdpa.supports_cascade(torch.bfloat16, 80, None)
    assert not torch_sdpa.supports_cascade(torch.float32, 128, 50.0)

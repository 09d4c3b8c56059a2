"""Cascade attention's math (vlite.attention.ops.cascade) against plain attention.

merge_attn_states of two partial results must equal attention over the concatenated keys (an empty
part included); cascade_decode_attention on random paged metadata (a shared prefix of 0..several
blocks, per-request suffixes of different lengths, shuffled block ids) must equal a float64 reference
of paged decode attention, and vlite's own decode path (torch_sdpa.paged_attention, which the runner
calls; with the C++ kernel where it builds).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from vlite import _custom_ops
from vlite.attention.backends import torch_sdpa
from vlite.attention.backends.torch_sdpa import build_metadata, get_kv_cache_shape, paged_attention
from vlite.attention.ops.cascade import attention_with_lse, cascade_decode_attention, merge_attn_states

D = 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k/v [S, Hkv, D] -> out [T, Hq, D], lse [T, Hq], every query seeing every key, float64."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->ths", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.einsum("ths,shd->thd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_attention_with_lse_matches_reference(heads, softcap):
    gen = torch.Generator().manual_seed(0)
    hq, hkv = heads
    q, k, v = (torch.randn(n, h, D, generator=gen, dtype=torch.float64) for n, h in ((5, hq), (23, hkv), (23, hkv)))
    out, lse = attention_with_lse(q, k, v, 0.3, softcap)
    ref_out, ref_lse = reference(q, k, v, 0.3, softcap)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_attention_with_lse_bf16_keeps_float32_statistics():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, D, generator=gen).bfloat16() for n, h in ((3, 6), (40, 2), (40, 2)))
    out, lse = attention_with_lse(q, k, v, D ** -0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, k, v, D ** -0.5)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # exact scores of bf16 inputs


def test_attention_with_lse_no_keys():
    q, kv = torch.randn(3, 4, D), torch.randn(0, 2, D)
    out, lse = attention_with_lse(q, kv, kv, 1.0)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("split", [0, 1, 17, 30])  # keys in part 1; 0 and 30: one part is empty
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_merge_equals_attention_over_concatenated_keys(split, softcap):
    gen = torch.Generator().manual_seed(split)
    q = torch.randn(7, 6, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(30, 2, D, generator=gen, dtype=torch.float64) * 3 for _ in range(2))
    o1, lse1 = attention_with_lse(q, k[:split], v[:split], 0.5, softcap)
    o2, lse2 = attention_with_lse(q, k[split:], v[split:], 0.5, softcap)
    ref_out, ref_lse = reference(q, k, v, 0.5, softcap)
    for o, lse in (merge_attn_states(o1, lse1, o2, lse2), merge_attn_states(o2, lse2, o1, lse1)):
        torch.testing.assert_close(o, ref_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_merge_float32_and_bf16():
    """Computed in float32 whatever o's dtype; o comes back in o1's dtype."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 4, D, generator=gen) for n in (9, 50, 50))
    ref_out, ref_lse = reference(q, k, v, 0.25)
    o1, lse1 = attention_with_lse(q, k[:20], v[:20], 0.25)
    o2, lse2 = attention_with_lse(q, k[20:], v[20:], 0.25)
    o, lse = merge_attn_states(o1, lse1, o2, lse2)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    o, lse = merge_attn_states(o1.bfloat16(), lse1, o2.bfloat16(), lse2)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), ref_out, atol=2e-2, rtol=2e-2)


def test_merge_empty_parts():
    """A part with lse = -inf is ignored even if its o holds NaN; two empty parts give 0 and -inf."""
    o, lse = torch.randn(3, 2, D), torch.randn(3, 2)
    nan_o, empty = torch.full_like(o, float("nan")), torch.full_like(lse, float("-inf"))
    for merged in (merge_attn_states(o, lse, nan_o, empty), merge_attn_states(nan_o, empty, o, lse)):
        torch.testing.assert_close(merged[0], o, atol=0, rtol=0)
        torch.testing.assert_close(merged[1], lse, atol=0, rtol=0)
    both, both_lse = merge_attn_states(nan_o, empty, nan_o, empty)
    assert torch.equal(both, torch.zeros_like(o)) and bool(torch.isneginf(both_lse).all())


def make_batch(num_reqs: int, prefix_blocks: int, block_size: int, hq: int, hkv: int, dtype: torch.dtype, seed: int,
               exact_prefix: bool = False) -> tuple[torch.Tensor, ...]:
    """A paged cache of random K/V, shuffled block ids, the first `prefix_blocks` shared by every row,
    suffixes of 1..~3 blocks (or none for the first request when `exact_prefix`), stale -1 entries past
    each row's last block; returns query [B, Hq, D], kv_cache, block_table [B, W] int32, seq_lens [B]."""
    gen = torch.Generator().manual_seed(seed)
    prefix_len = prefix_blocks * block_size
    seq_lens = prefix_len + torch.randint(1, 3 * block_size + 5, (num_reqs,), generator=gen)
    if exact_prefix and prefix_blocks:
        seq_lens[0] = prefix_len
    need = -(-seq_lens // block_size)
    width = int(need.max()) + 2
    num_blocks = prefix_blocks + int((need - prefix_blocks).sum()) + 7
    ids = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((num_reqs, width), -1, dtype=torch.int32)
    block_table[:, :prefix_blocks] = ids[:prefix_blocks].int()
    used = prefix_blocks
    for r in range(num_reqs):
        n = int(need[r]) - prefix_blocks
        block_table[r, prefix_blocks:prefix_blocks + n] = ids[used:used + n].int()
        used += n
    kv_cache = torch.randn(get_kv_cache_shape(num_blocks, block_size, hkv, D), generator=gen).to(dtype)
    query = torch.randn(num_reqs, hq, D, generator=gen).to(dtype)
    return query, kv_cache, block_table, seq_lens


def paged_reference(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    block_size: int, scale: float, softcap: Optional[float]) -> torch.Tensor:
    """Request by request: keys 0..seq_len-1 read slot by slot through the block table, float64."""
    outs = []
    for r in range(query.shape[0]):
        pos = torch.arange(int(seq_lens[r]))
        blocks, offsets = block_table[r].long()[pos // block_size], pos % block_size
        k = kv_cache[0][:, blocks, offsets].transpose(0, 1)  # [S, Hkv, D]
        v = kv_cache[1][:, blocks, offsets].transpose(0, 1)
        outs.append(reference(query[r:r + 1], k, v, scale, softcap)[0][0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("prefix_blocks", [0, 1, 5])
def test_cascade_decode_matches_reference(prefix_blocks, block_size, heads, softcap, dtype):
    hq, hkv = heads
    for seed, num_reqs in enumerate((1, 3, 13)):
        query, kv_cache, block_table, seq_lens = make_batch(num_reqs, prefix_blocks, block_size, hq, hkv, dtype, seed,
                                                            exact_prefix=seed == 2)
        out = cascade_decode_attention(query, kv_cache, block_table, seq_lens, prefix_blocks, block_size, D ** -0.5,
                                       softcap)
        assert out.dtype == dtype and out.shape == query.shape
        expected = paged_reference(query, kv_cache, block_table, seq_lens, block_size, D ** -0.5, softcap)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.fixture(params=["torch", "kernel"])
def decode_path(request, monkeypatch):
    """torch_sdpa's decode path without and with the C++ kernel (its best ISA here), as the runner runs it."""
    kernel = None
    if request.param == "kernel":
        kernel = _custom_ops.load()
        if kernel is None:
            pytest.skip("the C++ kernels did not build here")
    monkeypatch.setattr(torch_sdpa, "_decode_kernel", kernel)
    return request.param


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("block_size,prefix_blocks", [(4, 0), (4, 3), (16, 1), (16, 4)])
def test_cascade_decode_matches_torch_sdpa(decode_path, block_size, prefix_blocks, heads, softcap):
    """float32: the same outputs as the runner's paged decode attention within 1e-5."""
    hq, hkv = heads
    query, kv_cache, block_table, seq_lens = make_batch(11, prefix_blocks, block_size, hq, hkv, torch.float32, 7)
    num_reqs = query.shape[0]
    # This step's K/V are the ones already at each query's slot, so paged_attention's write changes nothing.
    pos = seq_lens - 1
    blocks, offsets = block_table.long()[torch.arange(num_reqs), pos // block_size], pos % block_size
    slot_mapping = blocks * block_size + offsets
    key, value = kv_cache[0][:, blocks, offsets].transpose(0, 1), kv_cache[1][:, blocks, offsets].transpose(0, 1)
    metadata = build_metadata(torch.arange(num_reqs + 1), seq_lens, block_table, slot_mapping, block_size)
    before = kv_cache.clone()
    expected = paged_attention(query, key.contiguous(), value.contiguous(), kv_cache, metadata, D ** -0.5,
                               softcap=softcap)
    assert torch.equal(kv_cache, before)
    out = cascade_decode_attention(query, kv_cache, block_table, seq_lens, prefix_blocks, block_size, D ** -0.5,
                                   softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cascade_rejects_prefix_not_shared():
    query, kv_cache, block_table, seq_lens = make_batch(3, 2, 4, 4, 4, torch.float32, 0)
    block_table[1, 1] = block_table[2, 2]
    with pytest.raises(AssertionError, match="differ"):
        cascade_decode_attention(query, kv_cache, block_table, seq_lens, 2, 4, 1.0)
    with pytest.raises(AssertionError, match="whole common prefix"):
        cascade_decode_attention(query, kv_cache, block_table, seq_lens.clamp(max=3), 1, 4, 1.0)

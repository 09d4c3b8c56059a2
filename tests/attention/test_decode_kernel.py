"""The C++ paged decode-attention kernel directly, every ISA build this CPU runs, against float64
attention on the unpaged K/V: head sizes with compiled fast paths (64, 128, 256) and the generic
one, grouped-query ratios, one to many requests (contexts of 256+ keys run split over keys, merged),
contexts shorter and longer than 16 keys, and sliding windows. A row's output is the same bits
alone, in any batch and on any number of threads (speculative verify rows must equal the decodes
they stand for)."""

from __future__ import annotations

import pytest
import torch

from vlite import _custom_ops

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in _custom_ops.supported_isas(),
                                                   reason=f"this CPU cannot run the {isa} build"))
        for isa in _custom_ops.ISAS]
BS, NUM_BLOCKS = 16, 96


def reference(q, k, v, lens, scale, window):
    """q [N, H, D]; k/v [N, L, H_kv, D] (unpaged) -> [N, H, D] in float64."""
    n, h, d = q.shape
    g = h // k.shape[2]
    out = torch.empty(n, h, d, dtype=torch.float64)
    for i, length in enumerate(lens):
        first = max(0, length - window) if window else 0
        kk = k[i, first:length].double().repeat_interleave(g, 1)
        vv = v[i, first:length].double().repeat_interleave(g, 1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[i].double() * scale, kk), -1)
        out[i] = torch.einsum("hk,khd->hd", p, vv)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d,h,h_kv", [(64, 9, 3), (64, 4, 4), (128, 8, 2), (256, 4, 1), (32, 6, 2), (80, 2, 1)])
@pytest.mark.parametrize("lens,window", [([1], 0), ([7, 200], 0), ([1000], 0), ([300, 17, 64, 512], 0),
                                         ([1000, 40], 128), ([5], 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_reference(isa, d, h, h_kv, lens, window, dtype):
    ops = _custom_ops.load(isa)
    g = torch.Generator().manual_seed(d + h + len(lens))
    n, max_len = len(lens), max(lens)
    per_req = -(-max_len // BS)
    k = torch.randn(n, per_req * BS, h_kv, d, generator=g).to(dtype)
    v = torch.randn(n, per_req * BS, h_kv, d, generator=g).to(dtype)
    q = torch.randn(n, h, d, generator=g).to(dtype)
    # Scatter each request's keys over shuffled blocks of one cache.
    key_cache = torch.zeros(h_kv, NUM_BLOCKS * 2, BS, d, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    perm = torch.randperm(NUM_BLOCKS * 2, generator=g)[:n * per_req].view(n, per_req)
    for i in range(n):
        for b in range(per_req):
            key_cache[:, perm[i, b]] = k[i, b * BS:(b + 1) * BS].transpose(0, 1)
            value_cache[:, perm[i, b]] = v[i, b * BS:(b + 1) * BS].transpose(0, 1)
    scale = d ** -0.5
    args = (q, key_cache, value_cache, perm.contiguous(), torch.tensor(lens), scale)
    out = ops.paged_decode_attention(*args, window) if window else ops.paged_decode_attention(*args)
    ref = reference(q, k, v, lens, scale, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for threads in (1, 3):  # the same bits on any number of threads
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            again = ops.paged_decode_attention(*args, window)
        finally:
            torch.set_num_threads(prev)
        assert torch.equal(again, out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_same_bits_alone_or_batched(isa, dtype):
    """The rows of a verify step (one request's consecutive positions) beside other requests, against
    each row computed alone: contexts below, at and past the key-split length."""
    ops = _custom_ops.load(isa)
    g = torch.Generator().manual_seed(7)
    h, h_kv, d = 9, 3, 64
    key_cache = torch.randn(h_kv, NUM_BLOCKS, BS, d, generator=g).to(dtype)
    value_cache = torch.randn(h_kv, NUM_BLOCKS, BS, d, generator=g).to(dtype)
    tables = torch.randperm(NUM_BLOCKS, generator=g)[:3 * 32].view(3, 32)
    lens = [250, 251, 252, 253, 254, 255, 256, 257, 258, 5, 500]  # 9 verify rows, then two decodes
    owner = [0] * 9 + [1, 2]
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    table = tables[owner].contiguous()
    batched = ops.paged_decode_attention(q, key_cache, value_cache, table, torch.tensor(lens), 0.125)
    for i, length in enumerate(lens):
        alone = ops.paged_decode_attention(q[i:i + 1], key_cache, value_cache, table[i:i + 1],
                                           torch.tensor([length]), 0.125)
        assert torch.equal(alone[0], batched[i]), i


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,h,h_kv", [(64, 9, 3), (128, 4, 2), (256, 4, 1)])
def test_prompt_rows_grouped_same_bits_as_alone(isa, dtype, d, h, h_kv):
    """A prompt's rows (one sequence's consecutive positions, read in groups that share each key
    block) beside another request's rows of the same lengths on other blocks and a windowed call:
    every row the bits it gets alone, and close to float64 attention."""
    ops = _custom_ops.load(isa)
    g = torch.Generator().manual_seed(11)
    key_cache = torch.randn(h_kv, NUM_BLOCKS * 2, BS, d, generator=g).to(dtype)
    value_cache = torch.randn(h_kv, NUM_BLOCKS * 2, BS, d, generator=g).to(dtype)
    tables = torch.randperm(NUM_BLOCKS * 2, generator=g)[:2 * 48].view(2, 48)
    lens = list(range(1, 40)) + list(range(230, 300)) + list(range(500, 530)) + [300, 301, 302, 700, 701, 702]
    owner = [0] * (len(lens) - 6) + [1, 1, 1, 0, 0, 0]
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    table = tables[owner].contiguous()
    for window in (0, 128):
        args = (q, key_cache, value_cache, table, torch.tensor(lens), d ** -0.5)
        batched = ops.paged_decode_attention(*args, window)
        for i, length in enumerate(lens):
            alone = ops.paged_decode_attention(q[i:i + 1], key_cache, value_cache, table[i:i + 1],
                                               torch.tensor([length]), d ** -0.5, window)
            assert torch.equal(alone[0], batched[i]), (window, i)
        k = torch.stack([key_cache[:, table[i]].permute(1, 2, 0, 3).reshape(-1, h_kv, d) for i in range(len(lens))])
        v = torch.stack([value_cache[:, table[i]].permute(1, 2, 0, 3).reshape(-1, h_kv, d) for i in range(len(lens))])
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(batched.double(), reference(q, k, v, lens, d ** -0.5, window), atol=tol, rtol=tol)


def test_decode_kernel_rejects_bad_seq_lens():
    ops = _custom_ops.load()
    cache = torch.zeros(1, 4, BS, 64)
    with pytest.raises(RuntimeError, match="seq_lens"):
        ops.paged_decode_attention(torch.zeros(1, 1, 64), cache, cache, torch.zeros(1, 2, dtype=torch.long),
                                   torch.tensor([33]), 0.125)

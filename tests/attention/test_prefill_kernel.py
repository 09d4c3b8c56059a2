"""The C++ blocked prefill kernel (`prefill_attention(query, key_cache, value_cache, block_ids, context_len,
scale)`: one request's prompt chunk, rows at positions context_len.., causal over its blocks), every ISA
build this CPU runs, against float64 attention: chunks that start the sequence or follow cached keys,
lengths across the 256-key chunks and the 96-vector row groups, grouped-query ratios, head sizes; a row's
bits whatever chunk it is computed in; and its refusals."""

from __future__ import annotations

import pytest
import torch

from vlite import _custom_ops

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in _custom_ops.supported_isas(),
                                                   reason=f"this CPU cannot run the {isa} build"))
        for isa in _custom_ops.ISAS]


def prompt_case(q_len: int, ctx: int, h: int, h_kv: int, d: int, bs: int, dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, ...]:
    """A prompt chunk of q_len rows after ctx cached keys, its blocks shuffled in a larger cache with spare
    table entries. Returns q, key cache, value cache, block ids."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-(ctx + q_len) // bs) + 2
    k = torch.randn(h_kv, nb + 7, bs, d, generator=g).to(dtype)
    v = torch.randn(h_kv, nb + 7, bs, d, generator=g).to(dtype)
    ids = torch.randperm(nb + 7, generator=g)[:nb]
    return torch.randn(q_len, h, d, generator=g).to(dtype), k, v, ids


def reference(q, k, v, ids, ctx, scale):
    q_len, h, d = q.shape
    h_kv, _, bs, _ = k.shape
    n = ctx + q_len
    keys = k[:, ids].reshape(h_kv, -1, d)[:, :n].double().repeat_interleave(h // h_kv, 0)
    values = v[:, ids].reshape(h_kv, -1, d)[:, :n].double().repeat_interleave(h // h_kv, 0)
    scores = torch.einsum("qhd,hkd->hqk", q.double(), keys) * scale
    causal = torch.arange(n)[None, :] <= (ctx + torch.arange(q_len))[:, None]
    return torch.einsum("hqk,hkd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d,h,h_kv", [(64, 9, 3), (128, 8, 2), (256, 4, 4), (64, 32, 8)])
@pytest.mark.parametrize("q_len,ctx,bs", [(1, 0, 16), (40, 0, 16), (300, 0, 32), (7, 700, 16), (130, 250, 16),
                                          (33, 512, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_reference(isa, d, h, h_kv, q_len, ctx, bs, dtype):
    ops = _custom_ops.load(isa)
    q, k, v, ids = prompt_case(q_len, ctx, h, h_kv, d, bs, dtype, seed=d + q_len + ctx)
    got = ops.prefill_attention(q, k, v, ids, ctx, d ** -0.5).double()
    ref = reference(q, k, v, ids, ctx, d ** -0.5)
    assert (got - ref).abs().max() < (3e-6 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_are_chunk_invariant(isa, dtype):
    """A prompt computed in one chunk or cut anywhere (across key chunks, row groups) gives the same bits."""
    ops = _custom_ops.load(isa)
    q, k, v, ids = prompt_case(600, 0, 9, 3, 64, 16, dtype, seed=5)
    whole = ops.prefill_attention(q, k, v, ids, 0, 0.125)
    for cuts in ([255, 257], [1, 100, 370], [299]):
        bounds = [0, *cuts, 600]
        parts = [ops.prefill_attention(q[a:b].contiguous(), k, v, ids, a, 0.125) for a, b in zip(bounds, bounds[1:])]
        torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)


def test_prefill_refusals():
    ops = _custom_ops.load()
    q, k, v, ids = prompt_case(20, 10, 4, 2, 64, 16, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="hold fewer"):
        ops.prefill_attention(q, k, v, ids[:1], 10, 0.125)
    bad = ids.clone()
    bad[0] = 10_000
    with pytest.raises(RuntimeError, match="outside"):
        ops.prefill_attention(q, k, v, bad, 10, 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        ops.prefill_attention(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), ids, 10,
                              0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.prefill_attention(q, k.bfloat16(), v.bfloat16(), ids, 10, 0.125)

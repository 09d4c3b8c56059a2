"""The C++ cascade path (`paged_decode_attention(..., num_prefix_blocks=P)`), every ISA build this CPU
runs, against float64 attention and against the plain kernel: rows that share their first P blocks (the
prefix attended once for all of them, in 256-key chunks and groups of query vectors), each with keys of
its own after it or none, grouped-query ratios, block sizes, head sizes 64/128/256; and its refusals."""

from __future__ import annotations

import pytest
import torch

from vlite import _custom_ops
from vlite.attention.ops.cascade import cascade_decode_attention

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in _custom_ops.supported_isas(),
                                                   reason=f"this CPU cannot run the {isa} build"))
        for isa in _custom_ops.ISAS]


def shared_prefix_case(n: int, h: int, h_kv: int, d: int, bs: int, p: int, own: list[int], dtype: torch.dtype,
                       seed: int) -> tuple[torch.Tensor, ...]:
    """n rows whose first p block-table entries are the same shuffled blocks, then own[i] keys of their own
    (rows cycle through `own`); unused table entries -1. Returns q, kv cache, block table, seq lens."""
    g = torch.Generator().manual_seed(seed)
    own_blocks = [-(-own[i % len(own)] // bs) for i in range(n)]
    num_blocks = p + sum(own_blocks) + 3
    kv = torch.randn(2, h_kv, num_blocks, bs, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    width = p + max(own_blocks) + 1
    table = torch.full((n, width), -1, dtype=torch.long)
    table[:, :p] = perm[:p]
    nxt = p
    for i, nb in enumerate(own_blocks):
        table[i, p:p + nb] = perm[nxt:nxt + nb]
        nxt += nb
    seq_lens = torch.tensor([p * bs + own[i % len(own)] for i in range(n)])
    q = torch.randn(n, h, d, generator=g).to(dtype)
    return q, kv, table, seq_lens


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d,h,h_kv", [(64, 9, 3), (128, 8, 2), (256, 4, 4)])
@pytest.mark.parametrize("bs,p,n,own", [(16, 1, 1, [1]), (16, 20, 9, [0, 1, 17, 40]), (32, 9, 40, [3, 70]),
                                        (16, 33, 3, [0])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_kernel_matches_reference(isa, d, h, h_kv, bs, p, n, own, dtype):
    ops = _custom_ops.load(isa)
    q, kv, table, seq_lens = shared_prefix_case(n, h, h_kv, d, bs, p, own, dtype, seed=d + n + p)
    scale = d ** -0.5
    args = (q, kv[0].contiguous(), kv[1].contiguous(), table, seq_lens, scale, 0)
    got = ops.paged_decode_attention(*args, p).double()
    plain = ops.paged_decode_attention(*args).double()
    ref = cascade_decode_attention(q.double(), kv.double(), table.clamp(min=0), seq_lens, 0, bs, scale)
    tol = 3e-6 if dtype == torch.float32 else 2e-2
    assert (got - ref).abs().max() < tol
    assert (got - plain).abs().max() < 2 * tol
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("isa", ISAS)
def test_cascade_rows_alone_and_batched(isa):
    """A row's cascade output does not depend on how many other rows share the step (groups of query
    vectors are cut by count, but each vector's arithmetic is its own)."""
    ops = _custom_ops.load(isa)
    q, kv, table, seq_lens = shared_prefix_case(70, 9, 3, 64, 16, 18, [5, 30], torch.bfloat16, seed=3)
    args = (kv[0].contiguous(), kv[1].contiguous())
    batched = ops.paged_decode_attention(q, *args, table, seq_lens, 0.125, 0, 18)
    for i in (0, 33, 69):
        alone = ops.paged_decode_attention(q[i:i + 1], *args, table[i:i + 1], seq_lens[i:i + 1], 0.125, 0, 18)
        torch.testing.assert_close(alone[0], batched[i], rtol=0, atol=0)


def test_cascade_refusals():
    ops = _custom_ops.load()
    q, kv, table, seq_lens = shared_prefix_case(3, 4, 2, 64, 16, 4, [8], torch.float32, seed=1)
    k, v = kv[0].contiguous(), kv[1].contiguous()
    with pytest.raises(RuntimeError, match="sliding window"):
        ops.paged_decode_attention(q, k, v, table, seq_lens, 0.125, 32, 4)
    bad = table.clone()
    bad[2, 1] = bad[2, 5]
    with pytest.raises(RuntimeError, match="does not share"):
        ops.paged_decode_attention(q, k, v, bad, seq_lens, 0.125, 0, 4)
    with pytest.raises(RuntimeError, match="shorter than"):
        ops.paged_decode_attention(q, k, v, table, seq_lens.clamp(max=60), 0.125, 0, 4)
    q48, kv48, table48, lens48 = shared_prefix_case(2, 2, 1, 48, 16, 2, [4], torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="head size"):
        ops.paged_decode_attention(q48, kv48[0].contiguous(), kv48[1].contiguous(), table48, lens48, 0.125, 0, 2)

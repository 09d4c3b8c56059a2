"""Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator, no value) on every CPU
path, against float64 attention with the sink as one more score: the C++ decode kernel (fast head sizes with
rows split and merged, the generic one, sliding windows), the blocked prefill kernel, the cascade kernel (the
sink added once, in the merge), and the torch path (einsum, prefill chunks and decodes of one step)."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_cascade_kernel import shared_prefix_case
from tests.attention.test_prefill_kernel import prompt_case
from vlite import _custom_ops
from vlite.attention.backends import torch_sdpa

ops = _custom_ops.load()
needs_kernels = pytest.mark.skipif(ops is None, reason="vlite's C++ kernels are not built here")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float,
           window: int, sinks: torch.Tensor) -> torch.Tensor:
    """q [Q, H, D] at `positions` over keys/values [L, H_kv, D] (positions 0..L-1), float64 -> [Q, H, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    key = torch.arange(keys.shape[0])[None, :]
    seen = (key <= positions[:, None]) & ((key > positions[:, None] - window) if window else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def sinks_for(h: int, seed: int) -> torch.Tensor:
    """Sinks around the scores' range, one far above it (that head's outputs near 0)."""
    s = torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2
    s[0] = 30.0
    return s.float()


@needs_kernels
@pytest.mark.parametrize("d,h,h_kv", [(64, 8, 2), (32, 6, 2)])  # the fast kernel (rows split), the generic one
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_sinks(d, h, h_kv, window, dtype):
    g = torch.Generator().manual_seed(d + window)
    lens = [1, 37, 700]  # 700 keys: the fast kernel splits the row in chunks and merges them
    rows = []
    for length in lens:
        keys = torch.randn(length, h_kv, d, generator=g).to(dtype)
        values = torch.randn(length, h_kv, d, generator=g).to(dtype)
        rows.append((keys, values))
    # one cache holding every request's blocks
    bs, width = 16, -(-max(lens) // 16)
    total = sum(-(-n // bs) for n in lens)
    cache = torch.zeros(2, h_kv, total + 2, bs, d, dtype=dtype)
    table = torch.zeros(len(lens), width, dtype=torch.long)
    perm = torch.randperm(total + 2, generator=g)
    nxt = 0
    for i, (keys, values) in enumerate(rows):
        for j in range(keys.shape[0]):
            if j % bs == 0:
                table[i, j // bs] = perm[nxt]
                nxt += 1
            cache[:, :, table[i, j // bs], j % bs] = torch.stack((keys[j], values[j]))
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    sinks = sinks_for(h, d)
    got = ops.paged_decode_attention(q, cache[0].contiguous(), cache[1].contiguous(), table, torch.tensor(lens),
                                     d ** -0.5, window, 0, sinks).double()
    for i, (keys, values) in enumerate(rows):
        want = attend(q[i:i + 1], keys, values, torch.tensor([lens[i] - 1]), d ** -0.5, window, sinks)[0]
        tol = 3e-6 if dtype == torch.float32 else 2e-2
        assert (got[i] - want).abs().max() < tol, i
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
        ops.paged_decode_attention(q, cache[0].contiguous(), cache[1].contiguous(), table, torch.tensor(lens),
                                   d ** -0.5, window, 0, sinks[:-1])


@needs_kernels
@pytest.mark.parametrize("q_len,ctx", [(40, 0), (130, 250)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_sinks(q_len, ctx, dtype):
    h, h_kv, d, bs = 8, 2, 64, 16
    q, k, v, ids = prompt_case(q_len, ctx, h, h_kv, d, bs, dtype, seed=q_len + ctx)
    sinks = sinks_for(h, q_len)
    got = ops.prefill_attention(q, k, v, ids, ctx, d ** -0.5, sinks).double()
    keys = k[:, ids].reshape(h_kv, -1, d)[:, :ctx + q_len].transpose(0, 1)
    values = v[:, ids].reshape(h_kv, -1, d)[:, :ctx + q_len].transpose(0, 1)
    want = attend(q, keys, values, ctx + torch.arange(q_len), d ** -0.5, 0, sinks)
    assert (got - want).abs().max() < (3e-6 if dtype == torch.float32 else 2e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_kernel_sinks(dtype):
    """The prefix once for all rows, each row's own keys, merged: the sink counted once."""
    h, h_kv, d, bs, p = 8, 2, 64, 16, 20
    q, kv, table, seq_lens = shared_prefix_case(9, h, h_kv, d, bs, p, [0, 1, 17, 40], dtype, seed=3)
    sinks = sinks_for(h, 4)
    args = (q, kv[0].contiguous(), kv[1].contiguous(), table, seq_lens, d ** -0.5, 0)
    got = ops.paged_decode_attention(*args, p, sinks).double()
    plain = ops.paged_decode_attention(*args, 0, sinks).double()
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        blocks = table[i, :-(-n // bs)]
        keys = kv[0][:, blocks].reshape(h_kv, -1, d)[:, :n].transpose(0, 1)
        values = kv[1][:, blocks].reshape(h_kv, -1, d)[:, :n].transpose(0, 1)
        want = attend(q[i:i + 1], keys, values, torch.tensor([n - 1]), d ** -0.5, 0, sinks)[0]
        tol = 3e-6 if dtype == torch.float32 else 2e-2
        assert (got[i] - want).abs().max() < tol and (plain[i] - want).abs().max() < tol, i


@pytest.mark.parametrize("window", [0, 9])
def test_torch_path_sinks(monkeypatch, window):
    """The torch path (no C++ kernels): a step of a prompt chunk after cached keys, a fresh prompt and a decode."""
    monkeypatch.setattr(torch_sdpa, "_decode_kernel", None)
    h, h_kv, d, bs = 4, 2, 16, 8
    g = torch.Generator().manual_seed(window)
    reqs = [(13, 6), (0, 11), (20, 1)]  # (cached, new) tokens
    sinks = sinks_for(h, 7)
    seqs = [(torch.randn(c + n, h_kv, d, generator=g), torch.randn(c + n, h_kv, d, generator=g),
             torch.randn(n, h, d, generator=g)) for c, n in reqs]
    blocks_per = [-(-(c + n) // bs) for c, n in reqs]
    kv_cache = torch.zeros(2, h_kv, sum(blocks_per) + 1, bs, d)
    table = torch.zeros(len(reqs), max(blocks_per), dtype=torch.long)
    nxt = 1
    for r, ((c, n), (keys, values, _)) in enumerate(zip(reqs, seqs)):
        table[r, :blocks_per[r]] = torch.arange(nxt, nxt + blocks_per[r])
        nxt += blocks_per[r]
        for j in range(c):  # the cached part; the step writes the rest
            kv_cache[:, :, table[r, j // bs], j % bs] = torch.stack((keys[j], values[j]))
    qsl = torch.tensor([0] + [n for _, n in reqs]).cumsum(0)
    seq_lens = torch.tensor([c + n for c, n in reqs])
    slots = torch.cat([table[r, p // bs] * bs + p % bs for r, (c, n) in enumerate(reqs)
                       for p in [torch.arange(c, c + n)]])
    meta = torch_sdpa.build_metadata(qsl, seq_lens, table, slots, bs, (window,))
    new = [(k[c:], v[c:]) for (c, _), (k, v, _) in zip(reqs, seqs)]
    out = torch_sdpa.paged_attention(torch.cat([s[2] for s in seqs]), torch.cat([k for k, _ in new]),
                                     torch.cat([v for _, v in new]), kv_cache, meta, d ** -0.5, window, None, sinks)
    for r, ((c, n), (keys, values, q)) in enumerate(zip(reqs, seqs)):
        want = attend(q, keys, values, c + torch.arange(n), d ** -0.5, window, sinks)
        assert (out[int(qsl[r]):int(qsl[r + 1])].double() - want).abs().max() < 1e-5, r

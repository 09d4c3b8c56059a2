"""Cascade attention's Triton kernels (vlite.attention.ops.triton_cascade).

A step is a shared prefix of P tokens (the same shuffled blocks at the head of every block-table row) and
requests (c, n): c context tokens of their own after the prefix, then n query tokens ((c, 1) a decode,
(c, n) a chunk; c = 0 a chunk starting right after a prefix-cache hit). Blocks no request holds are
NaN and table entries past a row's last block -1, so a stray read shows. Each pass is checked against
vlite.attention.ops.cascade (the torch reference) and float64, the whole cascade against float64
attention and the plain kernel. Tiny shapes: the Triton interpreter is ~600x slower than torch.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tests.attention.test_triton_unified_attention import reference
from vlite.attention.backends.torch_sdpa import get_kv_cache_shape
from vlite.attention.ops import cascade

D = 16


def make_step(reqs: list[tuple[int, int]], prefix_blocks: int, block_size: int, hq: int, hkv: int,
              dtype: torch.dtype, seed: int) -> dict:
    """The paged cache and metadata of a step: query [T, Hq, D], cache [2, Hkv, N, bs, D], block_table
    [B, W] int32, query_start_loc [B + 1], seq_lens [B], and each request's unpaged k/v [S, Hkv, D]."""
    gen = torch.Generator().manual_seed(seed)
    prefix_len = prefix_blocks * block_size
    seq_lens = [prefix_len + c + n for c, n in reqs]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = prefix_blocks + sum(b - prefix_blocks for b in need) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    prefix_ids = [ids.pop() for _ in range(prefix_blocks)]
    block_table = torch.full((len(reqs), max(need) + 1), -1, dtype=torch.int32)
    cache = torch.full(get_kv_cache_shape(num_blocks, block_size, hkv, D), float("nan"), dtype=dtype)
    prefix_kv = torch.randn(2, prefix_len, hkv, D, generator=gen)
    ks, vs = [], []
    for r, seq_len in enumerate(seq_lens):
        row = prefix_ids + [ids.pop() for _ in range(need[r] - prefix_blocks)]
        block_table[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
        kv = torch.cat((prefix_kv, torch.randn(2, seq_len - prefix_len, hkv, D, generator=gen)), 1).to(dtype)
        for j in range(seq_len):
            cache[:, :, row[j // block_size], j % block_size] = kv[:, j]
        ks.append(kv[0]), vs.append(kv[1])
    query = (torch.randn(sum(n for _, n in reqs), hq, D, generator=gen) * 2).to(dtype)
    qsl = torch.tensor([0] + [n for _, n in reqs]).cumsum(0)
    return dict(query=query, cache=cache, block_table=block_table, qsl=qsl, seq_lens=torch.tensor(seq_lens),
                max_query_len=max(n for _, n in reqs), prefix_len=prefix_len, ks=ks, vs=vs)


def suffix_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_start: int, scale: float,
                     softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, H, D] at the last Q positions of k/v [S, Hkv, D], seeing keys key_start..pos -> out, lse (float64)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
    scores = torch.einsum("qhd,shd->qhs", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None, None]
    key = torch.arange(k.shape[0])[None, None, :]
    scores = scores.masked_fill((key > pos) | (key < key_start), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("qhs,shd->qhd", torch.softmax(scores, -1), v), lse


STEPS = {
    "decodes": [(0, 1), (5, 1), (17, 1), (2, 1)],
    "mixed": [(3, 1), (0, 6), (11, 4), (20, 1)],
    "many": [(i % 5, 1) for i in range(18)] + [(0, 5)],  # 23 tokens: two programs of the prefix pass
}


@pytest.mark.parametrize("step,prefix_blocks,block_size,heads,softcap,dtype", [
    ("decodes", 2, 16, (4, 2), None, torch.float32),
    ("mixed", 1, 16, (4, 1), 4.0, torch.float32),
    ("mixed", 3, 8, (2, 2), None, torch.float16),
    ("decodes", 1, 32, (6, 2), None, torch.float16),
    ("many", 3, 16, (8, 2), 3.0, torch.float32),
])
def test_passes_and_cascade(triton_device, step, prefix_blocks, block_size, heads, softcap, dtype):
    from vlite.attention.ops.triton_cascade import cascade_attention
    from vlite.attention.ops.triton_unified_attention import prefix_attention, unified_attention

    reqs = STEPS[step]
    s = make_step(reqs, prefix_blocks, block_size, *heads, dtype, seed=prefix_blocks * 7 + block_size)
    dev = lambda name: s[name].to(triton_device)  # noqa: E731
    query, kc, vc, p = dev("query"), dev("cache")[0], dev("cache")[1], s["prefix_len"]
    num_tokens, hq = query.shape[:2]
    scale = D ** -0.5
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    lse = torch.empty(2, num_tokens, hq, dtype=torch.float32, device=triton_device)
    o_pre = prefix_attention(query, kc, vc, dev("block_table"), p, scale, softcap,
                             out=torch.empty(query.shape, device=triton_device), lse=lse[0])
    o_suf = unified_attention(query, kc, vc, dev("block_table"), dev("qsl"), dev("seq_lens"), s["max_query_len"],
                              scale, 0, softcap, out=torch.empty(query.shape, device=triton_device), key_start=p,
                              lse=lse[1])
    # the prefix pass against the torch reference on the gathered prefix, in float64
    ref_pre, ref_pre_lse = cascade.attention_with_lse(s["query"].double(), s["ks"][0][:p].double(),
                                                      s["vs"][0][:p].double(), scale, softcap)
    torch.testing.assert_close(o_pre.cpu().double(), ref_pre, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[0].cpu().double(), ref_pre_lse, atol=tol, rtol=tol)
    out = cascade_attention(query, kc, vc, dev("block_table"), dev("qsl"), dev("seq_lens"), s["max_query_len"], p,
                            scale, softcap).cpu()
    plain = unified_attention(query, kc, vc, dev("block_table"), dev("qsl"), dev("seq_lens"), s["max_query_len"],
                              scale, 0, softcap).cpu()
    assert out.dtype == dtype and not out.isnan().any()
    for r, (c, n) in enumerate(reqs):
        rows = slice(int(s["qsl"][r]), int(s["qsl"][r + 1]))
        q, k, v = s["query"][rows], s["ks"][r], s["vs"][r]
        ref_suf, ref_suf_lse = suffix_reference(q, k, v, p, scale, softcap)
        torch.testing.assert_close(o_suf[rows].cpu().double(), ref_suf, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[1][rows].cpu().double(), ref_suf_lse, atol=tol, rtol=tol)
        want = reference(q, k, v, 0, softcap)
        torch.testing.assert_close(out[rows].double(), want, atol=tol, rtol=tol, msg=lambda m: f"req {r}: {m}")
    torch.testing.assert_close(out, plain, atol=tol, rtol=tol)


def test_cascade_without_prefix_and_bad_length(triton_device):
    """common_prefix_len 0: the prefix part is empty (lse -inf) and the result is the plain kernel's."""
    from vlite.attention.ops.triton_cascade import cascade_attention
    from vlite.attention.ops.triton_unified_attention import unified_attention

    s = make_step([(4, 1), (0, 3)], 0, 16, 4, 2, torch.float32, seed=1)
    args = [s[k].to(triton_device) for k in ("query", "cache", "block_table", "qsl", "seq_lens")]
    query, cache, rest = args[0], args[1], args[2:]
    out = cascade_attention(query, cache[0], cache[1], *rest, s["max_query_len"], 0, 0.25)
    plain = unified_attention(query, cache[0], cache[1], *rest, s["max_query_len"], 0.25)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        cascade_attention(query, cache[0], cache[1], *rest, s["max_query_len"], 8, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_kernel_matches_reference(triton_device, dtype):
    """Random parts, a part empty (lse -inf, o NaN: never read), both empty (o 0, lse -inf)."""
    from vlite.attention.ops.triton_cascade import merge_attn_states

    gen = torch.Generator().manual_seed(3)
    t, h, d = 5, 3, 24  # a head dim that is not a power of 2
    o1, o2 = (torch.randn(t, h, d, generator=gen).to(dtype) for _ in range(2))
    lse1, lse2 = (torch.randn(t, h, generator=gen) * 4 for _ in range(2))
    lse1[1, :], lse2[2, 1], lse1[4, 2], lse2[4, 2] = float("-inf"), float("-inf"), float("-inf"), float("-inf")
    o1[1, :], o2[2, 1], o1[4, 2], o2[4, 2] = float("nan"), float("nan"), float("nan"), float("nan")
    want, want_lse = cascade.merge_attn_states(o1.double(), lse1.double(), o2.double(), lse2.double())
    out_lse = torch.empty(t, h, device=triton_device)
    got, got_lse = merge_attn_states(o1.to(triton_device), lse1.to(triton_device), o2.to(triton_device),
                                     lse2.to(triton_device), out_lse=out_lse)
    assert got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse.cpu().double(), want_lse, atol=1e-5, rtol=1e-5)
    assert got[4, 2].eq(0).all() and torch.isneginf(got_lse[4, 2])

"""The one-launch Triton paged attention against attention computed request by request on the
unpaged K/V in float64.

A batch is a list of (context, query_len) requests: (0, n) a chunk starting its sequence, (c, n) a
chunk continuing one, (c, 1) a decode. K/V live in a shuffled paged cache laid out as the CPU
backend's (get_kv_cache_shape); block sizes 16 and 32, GQA ratios 1, 2 and 4, sliding windows
(blocks behind every window filled with NaN, or their table entries -1: one read shows), soft-capping,
attention sinks (gpt-oss).
Shapes are tiny: the interpreter runs each program in numpy, ~600x slower than torch.
"""

from __future__ import annotations

import math

import pytest
import torch

from vlite.attention.backends.torch_sdpa import get_kv_cache_shape

D = 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, softcap: float | None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Q, H, D] at the last Q positions of k/v [L, H_kv, D] -> [Q, H, D] in float64; `sinks` [H]: one more
    score per head in each softmax, with no value."""
    q_len, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
    v = v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(head_dim)  # [H, Q, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    key = torch.arange(seq_len)[None, :]
    seen = (key <= pos) & ((key > pos - window) if window else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return (probs @ v).transpose(0, 1)


def run_batch(device: torch.device, reqs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
              window: int = 0, softcap: float | None = None, dtype: torch.dtype = torch.float32,
              head_dim: int = D, stale: str = "nan", sinks: torch.Tensor | None = None) -> None:
    """Build the paged cache and metadata for `reqs`, run the kernel, compare to `reference`."""
    from vlite.attention.ops.triton_unified_attention import unified_attention

    gen = torch.Generator().manual_seed(sum(c * 31 + n for c, n in reqs) + block_size + num_heads)
    seq_lens = [c + n for c, n in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_req) + 1
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int64)
    cache = torch.zeros(get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype)
    qs, ks, vs = [], [], []
    for r, ((ctx, q_len), seq_len) in enumerate(zip(reqs, seq_lens)):
        ids = [physical.pop() for _ in range(blocks_per_req[r])]
        block_table[r, :len(ids)] = torch.tensor(ids)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        q = (torch.randn(q_len, num_heads, head_dim, generator=gen) * (3.0 if softcap else 1.0)).to(dtype)
        for j in range(seq_len):
            cache[:, :, ids[j // block_size], j % block_size] = torch.stack((k[j], v[j]))
        if window:  # blocks no query of the step sees: freed and reused, or dropped from the table
            for b in range(max(0, ctx - window + 1) // block_size):
                if stale == "nan":
                    cache[:, :, ids[b]] = float("nan")
                else:
                    block_table[r, b] = -1
        qs.append(q), ks.append(k), vs.append(v)
    query = torch.cat(qs)
    qsl = torch.tensor([0] + [n for _, n in reqs]).cumsum(0)
    out = unified_attention(query.to(device), cache[0].to(device), cache[1].to(device), block_table.to(device),
                            qsl.to(device), torch.tensor(seq_lens).to(device), max(n for _, n in reqs),
                            head_dim ** -0.5, window, softcap,
                            sinks=None if sinks is None else sinks.to(device)).cpu()
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    for r, (q, k, v) in enumerate(zip(qs, ks, vs)):
        want = reference(q, k, v, window, softcap, sinks)
        got = out[int(qsl[r]):int(qsl[r + 1])].double()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"request {r} {reqs[r]}: {m}")


def test_decodes(triton_device):
    run_batch(triton_device, [(4, 1), (16, 1), (39, 1)], block_size=16, num_heads=4, num_kv_heads=2)


def test_fresh_chunks(triton_device):
    run_batch(triton_device, [(0, 7), (0, 20)], block_size=32, num_heads=2, num_kv_heads=2)


def test_continuing_chunks(triton_device):
    run_batch(triton_device, [(16, 5), (9, 12)], block_size=16, num_heads=4, num_kv_heads=1)


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(16, 4, 2), (32, 4, 1), (32, 3, 3)])
def test_mixed_batch(triton_device, block_size, num_heads, num_kv_heads):
    run_batch(triton_device, [(0, 9), (20, 1), (33, 6), (3, 1)], block_size, num_heads, num_kv_heads)


@pytest.mark.parametrize("stale", ["nan", "-1"])
def test_sliding_window(triton_device, stale):
    run_batch(triton_device, [(40, 1), (0, 13), (37, 5), (6, 1)], block_size=16, num_heads=4, num_kv_heads=2,
              window=8, stale=stale)


def test_softcap(triton_device):
    run_batch(triton_device, [(0, 6), (21, 1), (5, 3)], block_size=16, num_heads=4, num_kv_heads=2, softcap=5.0)


def test_float16_and_odd_head_dim(triton_device):
    run_batch(triton_device, [(0, 5), (18, 1), (7, 4)], block_size=16, num_heads=2, num_kv_heads=1,
              dtype=torch.float16, head_dim=24)


def test_attention_sinks(triton_device):
    """Sinks large and small against the scores (one dominates its row), with a window and without."""
    sinks = torch.tensor([2.0, -1.0, 6.0, 0.5])
    run_batch(triton_device, [(0, 6), (21, 1), (30, 4)], block_size=16, num_heads=4, num_kv_heads=2, sinks=sinks)
    run_batch(triton_device, [(40, 1), (0, 13)], block_size=16, num_heads=4, num_kv_heads=2, window=8, sinks=sinks)

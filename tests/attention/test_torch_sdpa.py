"""Paged attention (writes through slot_mapping, reads through block tables) against plain attention.

A step mixes one-token decodes, prompt chunks that start their sequence and chunks continuing one
(cached context), over a shuffled block table; every path (the C++ decode kernel, and without it
batched decodes, the single-decode float32 path, bf16 grouped matmuls; per-chunk prefills) must
equal softmax(q k^T / sqrt(D)) v computed request by request on the unpaged K/V. Sliding windows
and soft-capping likewise, with the blocks behind every query's window filled with NaN (what a
block freed and reused by another request may hold): one read of them shows in the output.
"""

from __future__ import annotations

import pytest
import torch

from vlite import _custom_ops
from vlite.attention.backends import torch_sdpa
from vlite.attention.backends.torch_sdpa import build_metadata, get_kv_cache_shape, paged_attention

H, H_KV, D, BS, NUM_BLOCKS = 6, 2, 16, 4, 1024


@pytest.fixture(params=["torch", *_custom_ops.ISAS], autouse=True)
def decode_path(request, monkeypatch):
    """Run every test with the torch decode path and with the C++ kernel of every ISA this CPU runs
    (an AVX-512 machine runs the AVX2 and portable builds too)."""
    kernel = None
    if request.param != "torch":
        if request.param not in _custom_ops.supported_isas():
            pytest.skip(f"this CPU cannot run the {request.param} build")
        kernel = _custom_ops.load(request.param)
        assert kernel is not None, "the C++ kernels failed to build"
    monkeypatch.setattr(torch_sdpa, "_decode_kernel", kernel)
    return request.param


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, window: int = 0,
              softcap: float | None = None) -> torch.Tensor:
    """q [Q, H, D] at positions ctx..ctx+Q-1; k/v [ctx+Q, H_kv, D] -> [Q, H, D], causal (keys in
    (p - window, p] for window > 0), scores soft-capped when asked, in float64."""
    q, k, v = q.double(), k.double().repeat_interleave(H // H_KV, 1), v.double().repeat_interleave(H // H_KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos_q = ctx + torch.arange(q.shape[0])[None, :, None]
    pos_k = torch.arange(k.shape[0])[None, None, :]
    hidden = (pos_k > pos_q) | ((pos_k <= pos_q - window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def run_step(specs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0, window: int = 0,
             softcap: float | None = None, decode_rows_below: int = 0, verify_lens: list[int] | None = None) -> None:
    """specs: (tokens already cached, tokens computed this step) per request. verify_lens: per request, the
    most tokens its chunk may have to run as decode rows (1 + its drafts, as the runner gives them)."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(get_kv_cache_shape(NUM_BLOCKS, BS, H_KV, D), generator=gen).to(dtype)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    max_blocks = max(-(-(c + n) // BS) for c, n in specs)
    block_table = torch.zeros(len(specs), max_blocks, dtype=torch.int64)
    full_k, full_v, used = [], [], 0
    for r, (ctx, n) in enumerate(specs):
        nb = -(-(ctx + n) // BS)
        block_table[r, :nb] = perm[used:used + nb]
        used += nb
        keys = torch.randn(ctx + n, H_KV, D, generator=gen).to(dtype)
        values = torch.randn(ctx + n, H_KV, D, generator=gen).to(dtype)
        for j in range(ctx):  # the cached context is already in the pages
            slot = block_table[r, j // BS] * BS + j % BS
            kv_cache[0].view(H_KV, -1, D)[:, slot] = keys[j]
            kv_cache[1].view(H_KV, -1, D)[:, slot] = values[j]
        if window:  # blocks no query of this step sees: freed, maybe reused; never to be read
            kv_cache[:, :, block_table[r, :max(0, ctx - window + 1) // BS]] = float("nan")
        full_k.append(keys)
        full_v.append(values)
    q_lens = torch.tensor([n for _, n in specs])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
    seq_lens = torch.tensor([c + n for c, n in specs])
    positions = torch.cat([torch.arange(c, c + n) for c, n in specs])
    rows = torch.repeat_interleave(torch.arange(len(specs)), q_lens)
    slot_mapping = block_table[rows, positions // BS] * BS + positions % BS
    query = torch.randn(int(q_lens.sum()), H, D, generator=gen).to(dtype)
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, specs)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, specs)])
    # a model with global and sliding layers: one view of the step per window; an all-decode step also
    # through the fast path the runner takes when it passes the step's longest query (1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    # (and a step whose every chunk is decode rows: the longest query as both figures)
    longest = int(q_lens.max())
    views: list[tuple[int | None, int | torch.Tensor]] = [(None, 1 if verify_lens is None else torch.tensor(verify_lens))]
    if all(n <= v for v, (_, n) in zip(verify_lens or [1] * len(specs), specs)):
        views.append((longest, longest))
    for max_query_len, max_decode_query_len in views:
        metadata = build_metadata(query_start_loc, seq_lens, block_table, slot_mapping, BS, windows=(0, window),
                                  decode_rows_below=decode_rows_below, max_query_len=max_query_len,
                                  max_decode_query_len=max_decode_query_len)
        out = paged_attention(query, key, value, kv_cache, metadata, D ** -0.5, window=window, softcap=softcap)
        for r, (ctx, n) in enumerate(specs):
            s, e = int(query_start_loc[r]), int(query_start_loc[r + 1])
            expected = reference(query[s:e], full_k[r], full_v[r], ctx, window, softcap)
            torch.testing.assert_close(out[s:e].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", [
    [(9, 1)],  # one decode
    [(9, 1), (0, 1), (30, 1), (3, 1)],  # decodes of different lengths (one with no context)
    [(c, 1) for c in range(0, 160, 7)],  # many decodes, contexts across many blocks
    [(0, 7)],  # a prompt chunk that starts its sequence
    [(0, 7), (5, 6), (12, 3), (0, 2)],  # fresh and continuing chunks
    [(9, 1), (0, 7), (17, 1), (5, 6), (2, 1)],  # everything in one step
])
def test_paged_attention_matches_reference(specs, dtype):
    run_step(specs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("specs,verify_lens", [
    ([(9, 5)], [5]),  # one request verifying 4 drafts
    ([(9, 5), (30, 1), (3, 16), (40, 2)], [5, 1, 16, 9]),  # verify chunks beside a decode (one drafted less)
    ([(9, 5), (0, 7), (17, 1)], [5, 1, 1]),  # beside a prompt chunk: not every chunk is decode rows
])
def test_verify_rows_match_reference(specs, verify_lens, dtype, window):
    """A speculative step: chunks of up to 1 + drafts tokens run as decode rows, each query seeing the
    keys up to its own position; a step of only such chunks also through the runner's fast path."""
    run_step(specs, dtype, window=window, verify_lens=verify_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(5, None), (1, None), (9, 2.0), (0, 2.0)])
@pytest.mark.parametrize("specs", [
    [(30, 1)],  # one decode far past its window
    [(30, 1), (0, 1), (3, 1), (57, 1), (8, 1)],  # decodes inside and past their windows
    [(0, 13)],  # a first chunk longer than the window
    [(0, 13), (22, 6), (12, 3), (0, 2)],  # fresh and continuing chunks
    [(29, 1), (0, 11), (17, 1), (21, 7), (2, 1)],  # everything in one step
])
def test_sliding_window_and_softcap_match_reference(specs, dtype, window, softcap):
    """Keys in (p - window, p] only, soft-capped scores; blocks behind every window hold NaN."""
    run_step(specs, dtype, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("specs", [
    [(0, 13)],  # a first chunk across the position where prompt tokens stop being decode rows
    [(0, 13), (5, 8), (12, 3), (0, 2), (9, 1)],  # chunks before, across and past it, beside a decode
])
def test_prompt_tokens_as_decode_rows_match_reference(specs, dtype, window):
    run_step(specs, dtype, window=window, decode_rows_below=10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_rows_same_bits_in_any_chunking(decode_path, dtype):
    """Below `decode_rows_below`, a prompt token's attention output is the same bits however the prompt
    is cut into chunks, and the same as the decode row at its position (SDPA's bits depend on the
    chunk boundaries: what a request generated depended on the step budget and its batch)."""
    if decode_path == "torch":
        pytest.skip("prompt tokens run as decode rows only through the C++ kernel")
    length, below = 300, 260
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(length, H_KV, D, generator=gen).to(dtype)
    values = torch.randn(length, H_KV, D, generator=gen).to(dtype)
    query = torch.randn(length, H, D, generator=gen).to(dtype)
    block_table = torch.randperm(NUM_BLOCKS, generator=gen)[:-(-length // BS)][None]

    def attend(cuts: list[int]) -> torch.Tensor:
        kv_cache = torch.zeros(get_kv_cache_shape(NUM_BLOCKS, BS, H_KV, D), dtype=dtype)
        out = []
        for start, end in zip(cuts[:-1], cuts[1:]):
            positions = torch.arange(start, end)
            slot_mapping = block_table[0, positions // BS] * BS + positions % BS
            metadata = build_metadata(torch.tensor([0, end - start]), torch.tensor([end]), block_table, slot_mapping,
                                      BS, decode_rows_below=below)
            out.append(paged_attention(query[start:end], keys[start:end], values[start:end], kv_cache, metadata,
                                       D ** -0.5))
        return torch.cat(out)

    whole = attend([0, length])
    for cuts in ([0, 37, 100, 101, 256, length], [0, 64, 128, 192, 256, length], list(range(length + 1))):
        assert torch.equal(attend(cuts)[:below], whole[:below]), cuts


def test_kv_written_through_slot_mapping():
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.zeros(get_kv_cache_shape(8, BS, H_KV, D))
    block_table = torch.tensor([[5, 2], [7, 0]])
    query_start_loc = torch.tensor([0, 2, 7])
    seq_lens = torch.tensor([5, 5])
    positions = torch.tensor([3, 4, 0, 1, 2, 3, 4])
    rows = torch.tensor([0, 0, 1, 1, 1, 1, 1])
    slot_mapping = block_table[rows, positions // BS] * BS + positions % BS
    key, value = torch.randn(7, H_KV, D, generator=gen), torch.randn(7, H_KV, D, generator=gen)
    paged_attention(torch.randn(7, H, D, generator=gen), key, value, kv_cache,
                    build_metadata(query_start_loc, seq_lens, block_table, slot_mapping, BS), D ** -0.5)
    for t in range(7):
        block, off = int(block_table[rows[t], positions[t] // BS]), int(positions[t] % BS)
        assert torch.equal(kv_cache[0][:, block, off], key[t]) and torch.equal(kv_cache[1][:, block, off], value[t])


def test_kernel_load_falls_back_without_a_compiler(monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(_custom_ops, "_modules", {})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    isa = _custom_ops.requested_isa()
    if _custom_ops._load_built(_custom_ops._build_name(isa, _custom_ops._compile_flags(isa))) is not None:
        assert _custom_ops.load() is not None  # a build that completed is imported: no compiler needed
        monkeypatch.setattr(_custom_ops, "_modules", {})
    monkeypatch.setattr(_custom_ops, "_load_built", lambda name: None)  # nothing built yet, and no compiler
    assert _custom_ops.load() is None
    monkeypatch.setattr(_custom_ops, "_modules", {})
    monkeypatch.setenv(_custom_ops.ENV_KERNELS, "0")
    assert _custom_ops.load() is None  # disabled: not even tried
    assert _custom_ops._modules == {}

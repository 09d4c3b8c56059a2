"""Cascade attention's Triton kernels (vlite.attention.ops.triton_cascade) and the Triton backend's cascade path.

A step is a shared prefix of P tokens (the same shuffled blocks at the head of every block-table row) and
requests (c, n): c context tokens of their own after the prefix, then n query tokens ((c, 1) a decode,
(c, n) a chunk; c = 0 a chunk starting right after a prefix-cache hit). Blocks no request holds are
NaN and table entries past a row's last block -1, so a stray read shows. Each pass is checked against
vlite.attention.ops.cascade (the torch reference) and float64, the whole cascade against float64
attention and the plain kernel. Tiny shapes: the Triton interpreter is ~600x slower than torch.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import numpy as np
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


def test_backend_cascade_matches_plain(triton_device):
    """paged_attention with common_prefix_len (K/V written first, as a step does) = without; a windowed layer
    falls back to the plain kernel; build_metadata refuses a length off the block grid."""
    from vlite.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionMetadata

    reqs, block_size = [(2, 1), (9, 1), (0, 4), (14, 1)], 16
    s = make_step(reqs, 2, block_size, 4, 2, torch.float32, seed=11)
    # This step's K/V: taken out of the cache, which then holds NaN at their slots until paged_attention writes.
    slots, keys, values = [], [], []
    for r, (c, n) in enumerate(reqs):
        for j in range(int(s["seq_lens"][r]) - n, int(s["seq_lens"][r])):
            slots.append(int(s["block_table"][r, j // block_size]) * block_size + j % block_size)
            keys.append(s["ks"][r][j]), values.append(s["vs"][r][j])
    slot_mapping = torch.tensor(slots)
    flat = s["cache"].view(2, s["cache"].shape[1], -1, D)
    flat[:, :, slot_mapping] = float("nan")
    key, value = torch.stack(keys).to(triton_device), torch.stack(values).to(triton_device)
    inputs = [x.to(triton_device) for x in (s["qsl"], s["seq_lens"], s["block_table"], slot_mapping)]
    outs = {}
    for p in (0, s["prefix_len"]):
        md = TritonAttentionBackend.build_metadata(*inputs, block_size, (0, 8), s["max_query_len"],
                                                   common_prefix_len=p)
        assert isinstance(md, TritonAttentionMetadata) and md.common_prefix_len == p
        for window in (0, 8):
            kv_cache = s["cache"].clone().to(triton_device)
            outs[p, window] = md.paged_attention(s["query"].to(triton_device), key, value, kv_cache, D ** -0.5,
                                                 window).cpu()
    assert not outs[s["prefix_len"], 0].isnan().any()
    torch.testing.assert_close(outs[s["prefix_len"], 0], outs[0, 0], atol=2e-5, rtol=2e-5)
    assert torch.equal(outs[s["prefix_len"], 8], outs[0, 8])  # the same kernel, the same launch
    with pytest.raises(ValueError, match="multiple"):
        TritonAttentionBackend.build_metadata(*inputs, block_size, common_prefix_len=24)


def test_use_cascade_attention():
    from vlite.attention.backends.triton_attn import TritonAttentionBackend

    use = TritonAttentionBackend.use_cascade_attention
    decodes = np.ones(64, dtype=np.int32)
    assert use(1024, decodes, 32, 8, 0)  # 512 programs (4 waves) read the prefix; cascading: 32 (1 wave)
    assert use(1024, list(decodes), 32, 8, 0)  # a list as well as an array
    assert not use(1024, decodes, 32, 8, 4096)  # a sliding window
    assert not use(128, decodes, 32, 8, 0)  # too short a prefix
    assert not use(1024, np.ones(7, dtype=np.int32), 32, 32, 0)  # too few requests
    assert not use(1024, np.ones(16, dtype=np.int32), 32, 8, 0)  # 128 programs: one wave either way
    assert use(1024, np.ones(17, dtype=np.int32), 32, 8, 0)  # 136 programs: two waves
    assert use(1024, np.ones(8, dtype=np.int32), 32, 32, 0)  # MHA: 256 programs vs 32
    assert use(512, np.array([1] * 40 + [37]), 32, 8, 0)  # a chunk among decodes: 41 x 8 programs vs 24
    assert not use(512, np.array([200] * 8), 32, 8, 0)  # long chunks: 13 x 8 x 8 = 832 programs vs 800


def test_cuda_graphs_run_cascade_steps_eagerly():
    from vlite.worker.cuda_graphs import CUDAGraphRunner

    graphs = SimpleNamespace(sizes=[1, 2, 4, 8])
    assert CUDAGraphRunner.padded_size(graphs, 3, 3) == 4
    assert CUDAGraphRunner.padded_size(graphs, 3, 3, common_prefix_len=256) is None


def test_gemma2_step_with_common_prefix(tmp_path, triton_device, monkeypatch):
    """A tiny Gemma 2 (GQA, soft-capping, a window-8 layer that falls back and a global one that cascades):
    a step of three requests after a 16-token shared block gives the same hidden states with and without
    common_prefix_len."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.models import tiny
    from vlite.attention.backends import triton_attn
    from vlite.attention.ops.triton_cascade import cascade_attention
    from vlite.attention.backends.triton_attn import TritonAttentionBackend
    from vlite.layers.quantization import QuantizationPlan
    from vlite.model_loader import load_model_weights, resolve_model
    from vlite.models.registry import build_model

    hf = tiny.build(Gemma2Config, Gemma2ForCausalLM, seed=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                    attn_logit_softcapping=1.5, hidden_activation="gelu_pytorch_tanh")
    hf.save_pretrained(tmp_path)
    arch, weights = load_model_weights(resolve_model(str(tmp_path)), torch.float32)
    model = build_model(arch, weights, QuantizationPlan(None), torch.float32).to(triton_device)
    block_size, backend = 16, TritonAttentionBackend
    shape = backend.get_kv_cache_shape(6, block_size, arch.num_key_value_heads, arch.head_dim)
    kv = [torch.zeros(shape, device=triton_device) for _ in range(arch.num_hidden_layers)]
    gen = torch.Generator().manual_seed(0)

    def run(reqs, kv_caches, common_prefix_len=0):
        inputs = {k: v.to(triton_device) for k, v in tiny.step_inputs(reqs, block_size).items()}
        md = backend.build_metadata(*(inputs[k] for k in ("query_start_loc", "seq_lens", "block_table",
                                                          "slot_mapping")),
                                    block_size, arch.attention_windows, max(n for _, n, _ in reqs),
                                    common_prefix_len=common_prefix_len)
        ids = torch.randint(0, tiny.VOCAB_SIZE, (int(inputs["query_start_loc"][-1]),), generator=gen)
        with torch.inference_mode():
            return model(ids.to(triton_device), inputs["positions"], kv_caches, md).cpu()

    run([(0, 16, [1])], kv)  # the shared prompt, into block 1
    step = [(16, 1, [1, 2]), (16, 5, [1, 3]), (16, 2, [1, 4])]
    state = gen.get_state()
    plain = run(step, [c.clone() for c in kv])
    gen.set_state(state)
    calls = []
    monkeypatch.setattr(triton_attn, "cascade_attention",
                        lambda *a, **k: calls.append(1) or cascade_attention(*a, **k))
    cascaded = run(step, kv, common_prefix_len=16)
    assert 0 < len(calls) < arch.num_hidden_layers  # the global layers cascaded, the windowed ones did not
    torch.testing.assert_close(cascaded, plain, atol=1e-4, rtol=1e-4)

"""The Gated DeltaNet C++ kernels (gated_delta.cpp, gated_delta_chunk.cpp: `gdn_conv1d`, `gated_delta_rule`,
`gdn_gated_rms_norm`), on every ISA build this CPU runs (the `ops` fixture, conftest.py), against float64
references written as the per-token recurrence: varlen batches of mixed lengths around the 64-token chunks,
shuffled state slots, grouped key heads, strided q/k/v, bfloat16 inputs; the chunked form against the
recurrent one at every cut of a segment; transformers' Qwen3.5 functions (the convention); and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------- references

def reference_gdn(q, k, v, g, beta, state, state_idx, qsl, scale, l2norm=True):
    """Per token, per value head, in float64: S = exp(g) S; delta = beta (v - S^T k); S += k delta^T; out = S^T q.
    Returns (out [T, Hv, Dv], the new state)."""
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1:]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q, k = q.repeat_interleave(Hv // Hk, 1), k.repeat_interleave(Hv // Hk, 1)
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * scale
    state = state.double().clone()
    out = torch.zeros(T, Hv, Dv, dtype=torch.float64)
    for r, slot in enumerate(state_idx.tolist()):
        S = state[slot]
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            S = S * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hij,hi->hj", S, k[t])) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hij,hi->hj", S, q[t])
        state[slot] = S
    return out, state


def reference_conv(x, weight, conv_state, state_idx, qsl):
    """y = previous inputs ++ x per channel; out[t] = silu(sum_j w[j] y[t + j]); state = the last K-1 of y."""
    K = weight.shape[1]
    w = weight.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    state = conv_state.double().clone()
    for r, slot in enumerate(state_idx.tolist()):
        a, b = int(qsl[r]), int(qsl[r + 1])
        y = torch.cat([state[slot].T, x[a:b].double()])
        for t in range(b - a):
            out[a + t] = F.silu((w.T * y[t:t + K]).sum(0))
        state[slot] = y[-(K - 1):].T
    return out, state


# ------------------------------------------------------------------------------------------------- inputs

def gdn_case(lengths, hk, hv, dk, dv, slots, dtype=torch.float32, seed=0, strided=False, l2norm=True):
    """Inputs of one varlen call: requests of `lengths` tokens in state slots `slots` of a state with spare
    slots; nonzero states. strided: q, k, v are views of one [T, 2 Hk Dk + Hv Dv] row (the model's split)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    if strided:
        mixed = torch.randn(T, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.view(T, hk, dk), k.view(T, hk, dk), v.view(T, hv, dv)
    else:
        q = torch.randn(T, hk, dk, generator=gen).to(dtype)
        k = torch.randn(T, hk, dk, generator=gen).to(dtype)
        v = torch.randn(T, hv, dv, generator=gen).to(dtype)
    if not l2norm:  # keys of norm ~0.7: the recurrence stays contracting
        k = (k.float() * 0.7 / dk ** 0.5).to(dtype)
    # log decays <= 0 as the model's -A * softplus(a + dt_bias): mostly mild, some strong
    g = -F.softplus(torch.randn(T, hv, generator=gen) - 1.0) * torch.rand(T, hv, generator=gen) * 2
    beta = torch.rand(T, hv, generator=gen)
    state = torch.randn(max(slots) + 3, hv, dk, dv, generator=gen) * 0.3
    qsl = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return q, k, v, g, beta, state, torch.tensor(slots, dtype=torch.int64), qsl


def assert_rel(got, ref, tol):
    err = (got.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    assert err < tol, f"relative error {err:.3g} > {tol}"


# ---------------------------------------------------------------------------------------------- the rule

@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 32), (4, 4, 64, 32), (1, 3, 16, 48), (2, 4, 32, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_rule_mixed_batch(ops, hk, hv, dk, dv, dtype):
    """One call of requests of 1, 3, 63, 64, 65, 200, 257 tokens in shuffled slots; other slots untouched."""
    lengths = [65, 1, 257, 3, 0, 64, 200, 63]
    slots = [7, 2, 9, 0, 4, 5, 1, 3]
    q, k, v, g, beta, state, idx, qsl = gdn_case(lengths, hk, hv, dk, dv, slots, dtype, seed=dk + dv + hv,
                                                 strided=dtype == torch.bfloat16)
    ref, ref_state = reference_gdn(q, k, v, g, beta, state, idx, qsl, dk ** -0.5)
    before = state.clone()
    out = ops.gated_delta_rule(q, k, v, g, beta, state, idx, qsl, dk ** -0.5, True)
    assert out.dtype == torch.float32 and out.shape == (sum(lengths), hv, dv)
    assert_rel(out, ref, 1e-4)
    assert_rel(state, ref_state, 1e-4)
    untouched = [s for s in range(state.shape[0]) if s not in slots]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("length", [1, 3, 63, 64, 65, 130])
def test_gated_delta_rule_full_heads(ops, length):
    """The real head shape (16 heads of 128), short."""
    q, k, v, g, beta, state, idx, qsl = gdn_case([length], 16, 16, 128, 128, [1], seed=length)
    ref, ref_state = reference_gdn(q, k, v, g, beta, state, idx, qsl, 128 ** -0.5)
    out = ops.gated_delta_rule(q, k, v, g, beta, state, idx, qsl, 128 ** -0.5, True)
    assert_rel(out, ref, 1e-4)
    assert_rel(state, ref_state, 1e-4)


@pytest.mark.parametrize("chunked_min_tokens", [1, 1000])
def test_gated_delta_rule_without_l2norm(ops, chunked_min_tokens):
    """use_qk_l2norm=False: q, k as given (keys of norm < 1), any scale; both forms."""
    q, k, v, g, beta, state, idx, qsl = gdn_case([70, 5], 2, 4, 32, 32, [0, 1], seed=3, l2norm=False)
    ref, ref_state = reference_gdn(q, k, v, g, beta, state, idx, qsl, 0.3, l2norm=False)
    out = ops.gated_delta_rule(q, k, v, g, beta, state, idx, qsl, 0.3, False, chunked_min_tokens)
    assert_rel(out, ref, 1e-4)
    assert_rel(state, ref_state, 1e-4)


@pytest.mark.parametrize("cuts", [[1], [64], [100, 200], list(range(1, 300))])
def test_chunked_equals_recurrent_at_every_cut(ops, cuts):
    """A 300-token segment whole (chunked) = the same cut into calls (each piece chunked or recurrent, the state
    carried), in outputs and final state."""
    q, k, v, g, beta, state, idx, qsl = gdn_case([300], 2, 4, 64, 64, [0], seed=11)
    whole_state = state.clone()
    whole = ops.gated_delta_rule(q, k, v, g, beta, whole_state, idx, qsl, 0.125, True)
    bounds = [0, *cuts, 300]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        parts.append(ops.gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, idx,
                                          torch.tensor([0, b - a]), 0.125, True))
    assert_rel(torch.cat(parts), whole.double(), 1e-5)
    assert_rel(state, whole_state.double(), 1e-5)


def test_recurrent_form_equals_chunked_form(ops):
    """The same mixed batch forced through each form (chunked_min_tokens 1: all chunked; 10**6: all recurrent)."""
    q, k, v, g, beta, state, idx, qsl = gdn_case([1, 5, 64, 150], 2, 2, 32, 32, [3, 1, 0, 2], seed=5)
    s_chunked, s_recurrent = state.clone(), state.clone()
    chunked = ops.gated_delta_rule(q, k, v, g, beta, s_chunked, idx, qsl, 0.2, True, 1)
    recurrent = ops.gated_delta_rule(q, k, v, g, beta, s_recurrent, idx, qsl, 0.2, True, 10 ** 6)
    assert_rel(chunked, recurrent.double(), 1e-5)
    assert_rel(s_chunked, s_recurrent.double(), 1e-5)


def test_matches_transformers_qwen3_5(ops):
    """transformers' torch_chunk_gated_delta_rule (prefill) and torch_recurrent_gated_delta_rule (decode) on one
    request, with their fixed scale Dk^-0.5 and l2-normalized q, k: the same outputs and state."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta, state, idx, qsl = gdn_case([100, 1], 2, 4, 64, 32, [0, 1], seed=7)
    scale = 64 ** -0.5
    init = state.clone()
    out = ops.gated_delta_rule(q, k, v, g, beta, state, idx, qsl, scale, True)
    ref, ref_state = modeling.torch_chunk_gated_delta_rule(
        q[None, :100], k[None, :100], v[None, :100], g[None, :100], beta[None, :100], initial_state=init[0:1],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_rel(out[:100], ref[0].double(), 1e-4)
    assert_rel(state[0], ref_state[0].double(), 1e-4)
    ref, ref_state = modeling.torch_recurrent_gated_delta_rule(
        q[None, 100:], k[None, 100:], v[None, 100:], g[None, 100:], beta[None, 100:], initial_state=init[1:2],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_rel(out[100:], ref[0].double(), 1e-4)
    assert_rel(state[1], ref_state[0].double(), 1e-4)


def test_gated_delta_rule_refusals(ops):
    q, k, v, g, beta, state, idx, qsl = gdn_case([3, 2], 2, 4, 32, 32, [0, 1])
    call = lambda **kw: ops.gated_delta_rule(**{**dict(q=q, k=k, v=v, g=g, beta=beta, state=state, state_idx=idx,
                                                         query_start_loc=qsl, scale=0.1, use_qk_l2norm=True), **kw})
    with pytest.raises(RuntimeError, match="multiple of the key heads"):
        call(q=q[:, :1].repeat(1, 3, 1), k=k[:, :1].repeat(1, 3, 1))
    with pytest.raises(RuntimeError, match="same shape"):
        call(q=q[:, :1])
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(v=v.bfloat16())
    with pytest.raises(RuntimeError, match="beta must be float32"):
        call(beta=beta[:, :2])
    with pytest.raises(RuntimeError, match="state must be a contiguous float32"):
        call(state=state[..., :16])
    with pytest.raises(RuntimeError, match="out of range"):
        call(state_idx=torch.tensor([0, 99]))
    with pytest.raises(RuntimeError, match="repeats slot"):
        call(state_idx=torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        call(query_start_loc=torch.tensor([0, 6, 5]))
    with pytest.raises(RuntimeError, match="end at T"):
        call(query_start_loc=torch.tensor([0, 3, 4]))
    with pytest.raises(RuntimeError, match="R \\+ 1"):
        call(query_start_loc=torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="multiples of 16"):
        call(q=q[..., :24], k=k[..., :24])


# ----------------------------------------------------------------------------------------------- conv1d

@pytest.mark.parametrize("K", [4, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_matches_reference(ops, K, dtype):
    """Segments shorter than K-1 (keeping part of the old state), decode tokens, long ones; a channel count
    that is not a multiple of 16; strided x rows."""
    gen = torch.Generator().manual_seed(K)
    lengths, slots, C = [1, 2, 0, 37, 3, 1], [4, 0, 6, 2, 5, 1], 72
    T = sum(lengths)
    x = torch.randn(T, C + 8, generator=gen).to(dtype)[:, 4:C + 4]
    w = torch.randn(C, K, generator=gen) * 0.5
    state = torch.randn(8, C, K - 1, generator=gen)
    idx, qsl = torch.tensor(slots), torch.tensor([0] + lengths).cumsum(0)
    ref, ref_state = reference_conv(x, w, state, idx, qsl)
    before = state.clone()
    out = ops.gdn_conv1d(x, w, state, idx, qsl)
    assert out.dtype == dtype and out.shape == (T, C)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), ref.to(dtype).double() if dtype != torch.float32 else ref, rtol=tol,
                               atol=tol)
    torch.testing.assert_close(state.double(), ref_state, rtol=0, atol=0)  # the inputs, copied exactly
    assert torch.equal(state[[3, 7]], before[[3, 7]])


@pytest.mark.parametrize("cuts", [[1], [2, 3], list(range(1, 20))])
def test_conv1d_carries_state_across_cuts(ops, cuts):
    """A 20-token segment whole = cut into calls (pieces shorter than K-1 included), bit for bit."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 48, generator=gen), torch.randn(48, 4, generator=gen)
    s_whole = torch.randn(2, 48, 3, generator=gen)
    s_cut = s_whole.clone()
    whole = ops.gdn_conv1d(x, w, s_whole, torch.tensor([1]), torch.tensor([0, 20]))
    bounds = [0, *cuts, 20]
    parts = [ops.gdn_conv1d(x[a:b], w, s_cut, torch.tensor([1]), torch.tensor([0, b - a]))
             for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(parts), whole) and torch.equal(s_cut, s_whole)


def test_conv1d_matches_transformers(ops):
    """transformers' causal_conv1d_fn (a prompt from a zero state) and causal_conv1d_update (a decode token)."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 32, generator=gen), torch.randn(32, 4, generator=gen)
    state = torch.zeros(1, 32, 3)
    out = ops.gdn_conv1d(x[:8], w, state, torch.tensor([0]), torch.tensor([0, 8]))
    ref = modeling.causal_conv1d_fn(x[None, :8].transpose(1, 2), w, None, activation="silu")[0].T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ref_state = x[5:8].T[None].clone()
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)
    out = ops.gdn_conv1d(x[8:], w, state, torch.tensor([0]), torch.tensor([0, 1]))
    ref = modeling.causal_conv1d_update(x[None, 8:].transpose(1, 2), ref_state, w, None, activation="silu")[0].T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)


def test_conv1d_refusals(ops):
    x, w, state = torch.randn(5, 32), torch.randn(32, 4), torch.zeros(3, 32, 3)
    idx, qsl = torch.tensor([0, 2]), torch.tensor([0, 2, 5])
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32"):
        ops.gdn_conv1d(x, w[:16], state, idx, qsl)
    with pytest.raises(RuntimeError, match="conv_state must be a contiguous float32"):
        ops.gdn_conv1d(x, w, torch.zeros(3, 32, 4), idx, qsl)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.gdn_conv1d(x.half(), w, state, idx, qsl)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gdn_conv1d(x, w, state, torch.tensor([0, 3]), qsl)
    with pytest.raises(RuntimeError, match="end at T"):
        ops.gdn_conv1d(x, w, state, idx, torch.tensor([0, 2, 4]))


# ------------------------------------------------------------------------------------------ gated rms norm

@pytest.mark.parametrize("zdtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(ops, zdtype):
    gen = torch.Generator().manual_seed(3)
    x, z = torch.randn(37, 128, generator=gen) * 2, (torch.randn(37, 128, generator=gen) * 4).to(zdtype)
    w = torch.randn(128, generator=gen)
    xd = x.double()
    ref = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(z.double())
    out = ops.gdn_gated_rms_norm(x, z, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        ops.gdn_gated_rms_norm(x, z, w[:64], 1e-6)

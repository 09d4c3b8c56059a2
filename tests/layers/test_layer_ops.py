"""The fused per-layer C++ ops (rms_norm, silu_and_mul, rotary_inplace), on every ISA build this CPU
runs (the `ops` fixture, conftest.py), against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlite.layers.rotary_embedding import RotaryEmbedding

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm(ops, dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    ref = w.float() * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5))
    out = ops.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_and_mul(ops, dtype, tol):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 2 * 96, generator=g) * 30).to(dtype)  # large |gate|: exp must not overflow
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 200.0, -200.0])
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = ops.silu_and_mul(gate_up)
    assert out.dtype == dtype and out.shape == (5, 96) and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_inplace(ops, dtype):
    heads, kv_heads, d = 9, 3, 64
    rope = RotaryEmbedding(d, 512, 10000.0, None)
    positions = torch.tensor([0, 1, 5, 300, 511])
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = qkv.clone().view(5, -1, d)
    expected[:, :heads + kv_heads] = RotaryEmbedding.apply(expected[:, :heads + kv_heads].float(),
                                                           *rope.get_cos_sin(positions, torch.float32)).to(dtype)
    ops.rotary_inplace(qkv, heads + kv_heads, d, *rope.get_cos_sin_f32(positions))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(qkv.view(5, -1, d).float(), expected.float(), atol=tol, rtol=tol)
    assert torch.equal(qkv.view(5, -1, d)[:, heads + kv_heads:], expected[:, heads + kv_heads:])  # v untouched


@pytest.mark.parametrize("d", [64, 48])  # the 16-lane path and the scalar one
def test_bfloat16_outputs_round_to_nearest_even_as_torch(ops, d):
    # rotary with sin = 0 and x = 1 writes cos itself: the kernels' float -> bf16 store, bit for bit
    g = torch.Generator().manual_seed(3)
    cos = torch.randn(4, d, generator=g) * torch.logspace(-30, 30, d)
    bits = cos.view(torch.int32)
    bits[0, :6] = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, -0x407F8000, 0x00008000],
                               dtype=torch.int32)  # ties to even (both ways), round up, to inf, negative, subnormal
    cos[1, :3] = torch.tensor([float("inf"), float("-inf"), 0.0])
    x = torch.ones(4, d, dtype=torch.bfloat16)
    ops.rotary_inplace(x, 1, d, cos, torch.zeros(4, d))
    assert torch.equal(x.view(torch.int16), cos.to(torch.bfloat16).view(torch.int16))
    cos[2, 5] = float("nan")
    x = torch.ones(4, d, dtype=torch.bfloat16)
    ops.rotary_inplace(x, 1, d, cos, torch.zeros(4, d))
    assert torch.isnan(x[2, 5]) and x.view(torch.int16)[2, 5] == 0x7FC0

"""Weight-only int8 / int4 linear layers against plain float32 reference code."""

from __future__ import annotations

import pytest
import torch

from vlite.layers.quantization import (INT4_GROUP_SIZE, QuantizedLinear, linear, make_linear, quantize_int4,
                                       quantize_int8)


def reference_int8(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def reference_int4(w: torch.Tensor, g: int = INT4_GROUP_SIZE) -> torch.Tensor:
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], g):
            block = w[r, c:c + g]
            lo, hi = block.min(), block.max()
            step = (hi - lo) / 15
            out[r, c:c + g] = torch.round((block - lo) / step).clamp(0, 15) * step + lo
    return out


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(48, 96, generator=torch.Generator().manual_seed(0))


def test_int8_values_match_reference(weight):
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    torch.testing.assert_close(q.float() * scale[:, None], reference_int8(weight))
    # Round to nearest: each weight within half a step.
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_int4_values_match_reference(weight):
    q, scale, zero = quantize_int4(weight)
    assert q.min() >= 0 and q.max() <= 15
    deq = (q.float().view(48, -1, INT4_GROUP_SIZE) - 8) * scale[..., None] + zero[..., None]
    torch.testing.assert_close(deq.view(48, 96), reference_int4(weight), atol=1e-5, rtol=1e-5)


def test_int4_repacks_q4_1_exactly():
    """Values on a Q4_1 grid (d * q + m, q spanning 0..15 in each group) come back exactly."""
    gen = torch.Generator().manual_seed(1)
    n, k = 32, 64
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 0.001
    m = torch.randn(n, k // 32, 1, generator=gen) * 0.1
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).view(n, k)
    layer = QuantizedLinear(w, "int4")
    assert layer.scales_and_zeros.dtype == torch.float32
    torch.testing.assert_close(layer.dequantize(), w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernel_equals_dequantized_matmul(weight, method, dtype):
    layer = QuantizedLinear(weight.to(dtype), method)
    deq = layer.dequantize()
    ref_weight = reference_int8(weight.to(dtype).float()) if method == "int8" else \
        reference_int4(weight.to(dtype).float())
    # Scales are stored in the activation dtype.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(deq, ref_weight, atol=tol, rtol=tol)
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = linear(x, layer)
    assert out.shape == (2, 5, 48) and out.dtype == dtype
    ref = x.float() @ deq.t()
    torch.testing.assert_close(out.float(), ref, atol=1e-4 if dtype == torch.float32 else 0.1,
                               rtol=1e-4 if dtype == torch.float32 else 2e-2)


def test_bias_and_dense_fallback():
    w = torch.randn(20, 64)  # N = 20: int4 packing needs N % 16 == 0
    assert make_linear(w, "int4") is w
    assert make_linear(w, None) is w
    q = make_linear(torch.randn(32, 64), "int8")
    assert isinstance(q, QuantizedLinear)
    x = torch.randn(3, 64)
    # A bias (e.g. Qwen-style fused QKV) is added to the packed product as to the dense one.
    torch.testing.assert_close(linear(x, q, torch.ones(32)), x @ q.dequantize().t() + 1, atol=1e-4, rtol=1e-4)
    hybrid = make_linear(torch.randn(32, 64), "int4", dense_above=2)
    torch.testing.assert_close(linear(x, hybrid, torch.ones(32)), x @ hybrid.dense.t() + 1)  # 3 rows: dense


def test_unknown_method_rejected():
    with pytest.raises(ValueError, match="quantization must be one of"):
        QuantizedLinear(torch.randn(16, 32), "int3")


def test_engine_rejects_unknown_quantization_before_loading():
    from vlite.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model="/nonexistent/model.gguf", quantization="fp8").create_engine_config()

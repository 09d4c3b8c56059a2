"""Block-quantized linear layers: every kernel build this CPU runs (the `ops` fixture, conftest.py)
against plain float reference code."""

from __future__ import annotations

import pytest
import torch

from vlite import _custom_ops
from vlite.layers.packed import QK, PackedTensors
from vlite.layers.quantization import (
    QuantizationPlan,
    QuantizedLinear,
    linear,
    make_linear,
    plan_quantization,
    quantize_int4,
    quantize_int8,
)

def random_packed(fmt: str, n: int, k: int, sub: int = 32, scale_dtype=torch.float16, mins: bool = True,
                  seed: int = 0) -> PackedTensors:
    g = torch.Generator().manual_seed(seed)
    if fmt == "q4":
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    else:
        qs = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = ((torch.rand(n, k // sub, generator=g) * 0.02 + 0.001) *
              torch.where(torch.rand(n, k // sub, generator=g) < 0.2, -1.0, 1.0)).to(scale_dtype)
    m = (torch.randn(n, k // QK, generator=g) * 0.05).to(scale_dtype) if mins else None
    return PackedTensors(fmt, qs, scales, m, sub)


def quantized_activations_reference(x: torch.Tensor, precise: bool = False) -> torch.Tensor:
    """What the kernels multiply by: x rounded to int8 blocks of 32 with d = max|x| / 127, plus
    (`precise`, float32 activations) the rounding error rounded to int8 steps of d / 256."""
    m, k = x.shape
    xb = x.float().view(m, k // QK, QK)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    t = xb * inv
    q = torch.round(t)
    out = q * d
    if precise:
        out = out + torch.round((t - q) * 256).clamp(-127, 127) * (d / 256)
    return out.view(m, k)


LAYOUTS = [("q4", 32, torch.float16, True), ("q4", 32, torch.float32, True), ("q8", 32, torch.float16, False),
           ("q8", 32, torch.float32, True), ("q8", 16, torch.float32, False)]


@pytest.mark.parametrize("fmt,sub,scale_dtype,mins", LAYOUTS)
@pytest.mark.parametrize("k", [32, 96, 224, 576])  # 1, 3, 7 and 18 blocks: every group/tail split
def test_kernel_matches_reference(ops, fmt, sub, scale_dtype, mins, k):
    p = random_packed(fmt, 37, k, sub, scale_dtype, mins, seed=k)  # 37 rows: two whole tiles and a part
    w = p.dequantize()
    t = p.tiled()
    args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    assert torch.equal(ops.dequantize(*args, torch.float32), w)
    for m in (1, 2, 3, 4, 5, 9, 11, 17):  # 9, 17: a last pass of 9 rows (q4)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            y = ops.quant_linear(x, *args)
            assert y.shape == (m, 37) and y.dtype == dtype
            # Exactly the int8-activation product (up to float32 summation order) ...
            precise = dtype == torch.float32 and m <= ops.precise_max_rows()  # the residual row: small steps
            ref = quantized_activations_reference(x, precise=precise) @ w.t()
            tol = ref.abs().max().item() * (1e-5 if dtype == torch.float32 else 8e-3)
            assert (y.float() - ref).abs().max().item() <= tol
            # ... and close to the float one (int8 activations: ~0.5% of the output scale; with the
            # residual row, float32 activations: ~16-bit accurate).
            full = x.float() @ w.t()
            rel = 1e-3 if precise else 0.03
            assert (y.float() - full).abs().max().item() <= rel * full.abs().max().item() + 1e-4


@pytest.mark.parametrize("fmt,sub,scale_dtype,mins", [LAYOUTS[0], LAYOUTS[4]])
def test_long_steps_match_reference(ops, fmt, sub, scale_dtype, mins):
    """Prefill-sized steps: the kernels take the rows in L2-sized blocks (112 rows at K=576) and in
    groups of up to 8; 261 rows leave a part block and a part group."""
    p = random_packed(fmt, 40, 576, sub, scale_dtype, mins, seed=3)
    t = p.tiled()
    x = torch.randn(261, 576, generator=torch.Generator().manual_seed(5))
    y = ops.quant_linear(x, t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    ref = quantized_activations_reference(x) @ p.dequantize().t()
    assert (y - ref).abs().max().item() <= ref.abs().max().item() * 1e-5


@pytest.mark.parametrize("fmt,sub,scale_dtype,mins", LAYOUTS)
def test_tiled_layout_round_trips(fmt, sub, scale_dtype, mins):
    """The kernels' row-tiled copy holds every value of the row-major one, in the documented places."""
    p = random_packed(fmt, 21, 64, sub, scale_dtype, mins)
    t = p.tiled()
    assert t.qt.shape == (2, 64 * 16 // (2 if fmt == "q4" else 1)) and t.scales.shape == (2, 64 // sub, 16)
    back = t.untiled()
    for a, b in ((p.qs, back.qs), (p.scales, back.scales), (p.mins, back.mins)):
        assert (a is None and b is None) or torch.equal(a, b)
    # row 17 = tile 1, lane 1; block 1, chunk 2: its 4 bytes sit at (1 * chunks + 2) * 64 + 1 * 4
    chunks = 4 if fmt == "q4" else 8
    got = t.qt[1, (1 * chunks + 2) * 64 + 4:(1 * chunks + 2) * 64 + 8]
    if fmt == "q4":
        assert torch.equal(got, p.qs[17, 16 + 8:16 + 12])  # block 1's bytes 8..11
    else:
        assert torch.equal(got, (p.qs[17, 32 + 8:32 + 12].view(torch.uint8) ^ 0x80))


def test_activation_quantization(ops):
    """Values, scales and sums of the int8 activations (and of the residual rows of `precise`)."""
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    nb = 576 // QK
    q, d, ds, hs = ops.quantize_activations(x)
    torch.testing.assert_close(q.float() * d.repeat_interleave(QK, 1), quantized_activations_reference(x),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(ds, d * q.view(3, nb, QK).sum(-1).float())
    assert torch.equal(hs, q.view(3, 2 * nb, 16).sum(-1, dtype=torch.int32))
    # precise: rows 2m (value) and 2m + 1 (residual, scale d / 256)
    qp, dp, dsp, hsp = ops.quantize_activations(x, True)
    assert qp.shape == (6, 576) and torch.equal(qp[0::2], q) and torch.equal(dp[0::2], d)
    torch.testing.assert_close(dp[1::2], d / 256)
    assert torch.equal(hsp, qp.view(6, 2 * nb, 16).sum(-1, dtype=torch.int32))
    deq = (qp.float() * dp.repeat_interleave(QK, 1)).view(3, 2, 576).sum(1)
    # (a residual that lands on a rounding tie may go either way: one residual step)
    step = d.repeat_interleave(QK, 1) / 256
    assert ((deq - quantized_activations_reference(x, precise=True)).abs() <= step * 1.01 + 1e-7).all()
    assert ((deq - x).abs() <= d.repeat_interleave(QK, 1) / 256 + 1e-6).all()  # half a step, or a clamped one


def test_zero_rows_and_empty_batch(ops):
    t = random_packed("q4", 16, 64, mins=False).tiled()
    args = (t.qt, t.scales, t.mins, 4, 32, 16)
    assert ops.quant_linear(torch.zeros(2, 64), *args).abs().max() == 0
    assert ops.quant_linear(torch.zeros(0, 64), *args).shape == (0, 16)


def test_kernel_rejects_bad_layouts(ops):
    t = random_packed("q4", 16, 64).tiled()
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        ops.quant_linear(torch.randn(1, 48), t.qt, t.scales, t.mins, 4, 32, 16)
    with pytest.raises(RuntimeError, match="sub must be"):
        ops.quant_linear(torch.randn(1, 64), t.qt, t.scales, t.mins, 4, 16, 16)
    with pytest.raises(RuntimeError, match="bad tiled weight"):
        ops.quant_linear(torch.randn(1, 64), t.qt, t.scales, t.mins, 4, 32, 17)  # 17 rows need 2 tiles


def reference_int8(w: torch.Tensor) -> torch.Tensor:
    wb = w.view(w.shape[0], -1, QK)
    d = (wb.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(wb / d).clamp(-127, 127) * d).view_as(w)


def reference_int4(w: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], QK):
            block = w[r, c:c + QK]
            lo, step = block.min().half().float(), ((block.max() - block.min()) / 15).half().float()
            out[r, c:c + QK] = torch.round((block - lo) / step).clamp(0, 15) * step + lo
    return out


def test_int8_and_int4_round_to_nearest():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    q8 = quantize_int8(w)
    torch.testing.assert_close(q8.dequantize(), reference_int8(w), atol=1e-6, rtol=1e-6)
    q4 = quantize_int4(w)
    torch.testing.assert_close(q4.dequantize(), reference_int4(w), atol=1e-5, rtol=1e-5)
    # Each weight within half a step of its block (plus the float16 rounding of the grid).
    step = q4.scales.float().repeat_interleave(QK, 1)
    assert ((q4.dequantize() - w).abs() <= step * 0.51 + 1e-3).all()


def test_q4_1_grid_requantizes_exactly():
    """Values on a Q4_1 grid (float16 d and m, q spanning 0..15 in each block) come back exactly."""
    g = torch.Generator().manual_seed(1)
    n, k = 32, 64
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.001).half().float()
    m = (torch.randn(n, k // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).view(n, k)
    torch.testing.assert_close(quantize_int4(w).dequantize(), w, atol=2e-3 * d.max().item(), rtol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_layer_bias_dense_above_and_torch_fallback(method, monkeypatch):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    plan = QuantizationPlan(method, dense_above=2)
    layer = make_linear(w, plan, torch.float32)
    assert isinstance(layer, QuantizedLinear)
    deq = layer.dequantize()
    x = torch.randn(3, 64)
    # A bias (e.g. Qwen-style fused QKV) is added to the packed product as to the dense one.
    ref = x[:2] @ deq.t() + 1
    torch.testing.assert_close(linear(x[:2], layer, torch.ones(32)), ref, atol=0.02 * ref.abs().max().item(), rtol=0)
    # 3 rows > dense_above: the dense GEMM on the dequantized weight (same weight values).
    torch.testing.assert_close(linear(x, layer, torch.ones(32)), x @ deq.t() + 1, atol=1e-5, rtol=1e-5)
    # Without the C++ kernels the layer keeps only the dense weight and gives the same dense result.
    monkeypatch.setattr(_custom_ops, "load", lambda isa=None: None)
    fallback = make_linear(w, plan, torch.float32)
    assert fallback.tiled is None and torch.equal(fallback.dense, deq)
    torch.testing.assert_close(linear(x[:1], fallback), x[:1] @ deq.t(), atol=1e-5, rtol=1e-5)


def test_head_stays_int8_and_odd_shapes_stay_dense():
    w = torch.randn(64, 64)
    assert make_linear(w, QuantizationPlan("int4"), torch.float32, head=True).fmt == 8
    assert make_linear(w, QuantizationPlan("int4"), torch.float32).fmt == 4
    odd = torch.randn(16, 40)  # K not a multiple of 32
    assert isinstance(make_linear(odd, QuantizationPlan("int8"), torch.float32), torch.Tensor)
    assert isinstance(make_linear(w, QuantizationPlan(None), torch.float32), torch.Tensor)


def test_plan():
    assert plan_quantization(None, "Q4_1", torch.bfloat16).method == "gguf"
    assert plan_quantization(None, "Q4_1", torch.float32, dtype_was_auto=True).method == "gguf"
    # float32 asked for explicitly: the reference precision, dense.
    assert plan_quantization(None, "Q4_1", torch.float32, dtype_was_auto=False).method is None
    assert plan_quantization(None, None, torch.bfloat16).method is None
    assert plan_quantization("none", "Q4_1", torch.bfloat16).method is None
    assert plan_quantization("int8", None, torch.float32).method == "int8"
    # every step on the kernels (they beat dense GEMMs at every measured size), no dense copy
    for dtype in (torch.bfloat16, torch.float32):
        plan = plan_quantization(None, "Q4_1", dtype)
        assert plan.dense_above is None and not plan.keep_dense
    with pytest.raises(ValueError, match="quantization must be one of"):
        plan_quantization("int3", None, torch.float32)


def test_engine_rejects_unknown_quantization_before_loading():
    from vlite.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model="/nonexistent/model.gguf", quantization="fp8").create_engine_config()


def test_forced_isa_is_checked(monkeypatch):
    monkeypatch.setenv(_custom_ops.ENV_ISA, "sse9")
    with pytest.raises(ValueError, match="VLITE_CPU_ISA must be one of"):
        _custom_ops.requested_isa()
    monkeypatch.setenv(_custom_ops.ENV_ISA, "portable")
    assert _custom_ops.requested_isa() == "portable"
    monkeypatch.setattr(_custom_ops, "cpu_flags", lambda: "flags : fpu sse2")
    monkeypatch.setenv(_custom_ops.ENV_ISA, "avx2")
    with pytest.raises(ValueError, match="lacks"):
        _custom_ops.requested_isa()
    monkeypatch.delenv(_custom_ops.ENV_ISA)
    assert _custom_ops.requested_isa() == "portable"


def test_bench_report_names_cpu_flags_and_kernels(monkeypatch):
    from vlite.benchmarks.utils import hardware_report, print_hardware

    monkeypatch.setenv(_custom_ops.ENV_ISA, "portable")
    report = hardware_report(None)
    assert report["kernels"] == "portable" and report["forced_isa"] == "portable"
    assert set(report["cpu_flags"]) <= set(_custom_ops.cpu_flags().split())
    print_hardware(report)


def test_fused_weights_of_mixed_gguf_types_stay_packed():
    """A K-quant file may mix Q4_K and Q6_K inside one fused projection: the parts stay packed, as row
    groups of one layout each (a ConcatLinear), and the layer computes what the dense weights do."""
    from vlite.layers.linear import linear_weight
    from vlite.layers.quantization import ConcatLinear
    from vlite.models.llama import _fuse

    a, b = random_packed("q4", 8, 64, seed=1), random_packed("q8", 4, 64, sub=16, scale_dtype=torch.float32,
                                                            mins=False, seed=2)
    c = random_packed("q4", 16, 64, seed=4)
    fused = _fuse([a, c, b])
    assert isinstance(fused, list) and [p.shape for p in fused] == [(24, 64), (4, 64)]
    dense = torch.cat([a.dequantize(), c.dequantize(), b.dequantize()])
    w = linear_weight(fused, QuantizationPlan("gguf"), torch.float32)
    assert isinstance(w, ConcatLinear) and w.out_features == 28 and len(w.parts) == 2
    assert torch.equal(w.dequantize(), dense)
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x, w), x @ dense.T, rtol=0.02, atol=0.02)
    assert torch.equal(linear_weight(fused, QuantizationPlan(None), torch.float32), dense)  # dense plan: one matrix
    same = _fuse([a, random_packed("q4", 4, 64, seed=3)])
    assert isinstance(same, PackedTensors) and same.shape == (12, 64)


@pytest.mark.parametrize("fmt,sub", [("q4", 32), ("q8", 32), ("q8", 16)])
def test_precise_can_be_chosen_per_call(ops, fmt, sub):
    """`precise` overrides the dtype's default: the residual row for bf16, a single int8 row for float32."""
    p = random_packed(fmt, 40, 96, sub, torch.float16, fmt == "q4")
    t = p.tiled()
    args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    w = p.dequantize()
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(9))
    for dtype, precise in ((torch.float32, False), (torch.bfloat16, True)):
        xd = x.to(dtype)
        y = ops.quant_linear(xd, *args, None, precise).float()
        ref = quantized_activations_reference(xd, precise=precise) @ w.t()
        tol = ref.abs().max().item() * (1e-5 if dtype == torch.float32 else 8e-3)
        assert (y - ref).abs().max().item() <= tol


def test_float32_residual_row_only_in_small_steps(ops):
    """By default float32 activations get the residual row in steps of up to precise_max_rows rows
    (decodes), a single int8 row in longer ones (prefill chunks)."""
    p = random_packed("q4", 32, 64)
    t = p.tiled()
    args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    w = p.dequantize()
    limit = ops.precise_max_rows()
    for m, precise in ((limit, True), (limit + 1, False)):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        ref = quantized_activations_reference(x, precise=precise) @ w.t()
        assert (ops.quant_linear(x, *args) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_precise_rows_decide_for_the_whole_step(ops):
    """precise_rows=n (the step's, from TorchSDPAMetadata.precise_rows: a verify step's rows less its
    drafts): a 12-row call computes every row as a 1-row call does, bit for bit; without it the call's
    own rows decide."""
    p = random_packed("q4", 48, 96)
    t = p.tiled()
    args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    x = torch.randn(12, 96, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([ops.quant_linear(x[i:i + 1], *args) for i in range(12)])
    assert torch.equal(ops.quant_linear(x, *args, precise_rows=1), alone)
    assert not torch.equal(ops.quant_linear(x, *args), alone)  # 12 rows: a single int8 row each
    # the layer passes it down (the model's linear layers read it from the step's attention metadata)
    layer = QuantizedLinear(p, torch.float32)  # on the default build's kernels
    alone = torch.cat([linear(x[i:i + 1], layer) for i in range(12)])
    assert torch.equal(linear(x, layer, precise_rows=1), alone)
    assert not torch.equal(linear(x, layer), alone)


@pytest.mark.parametrize("fmt,sub,scale_dtype,mins", [LAYOUTS[0], LAYOUTS[2]])
def test_rows_same_bits_in_any_step_size(ops, fmt, sub, scale_dtype, mins):
    """A row's output does not depend on how many rows share its call (passes of 8 rows, a last one of
    9 for q4): a speculative verify step's rows equal the 1-row decodes they stand for."""
    p = random_packed(fmt, 40, 96, sub, scale_dtype, mins, seed=11)
    t = p.tiled()
    args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    x = torch.randn(25, 96, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    alone = torch.cat([ops.quant_linear(x[i:i + 1], *args) for i in range(25)])
    for m in (8, 9, 16, 17, 25):
        assert torch.equal(ops.quant_linear(x[:m], *args), alone[:m]), m


@pytest.mark.parametrize("fmt,sub,scale_dtype,mins", [LAYOUTS[0], LAYOUTS[2], LAYOUTS[4]])
def test_float32_output_of_bf16_activations(ops, fmt, sub, scale_dtype, mins):
    """out_dtype=float32 (the LM head's logits): the float32 sums as they are; the bf16 output is those
    same sums rounded to bf16 (nearest even), residual included. A wrong residual dtype is refused."""
    p = random_packed(fmt, 37, 224, sub, scale_dtype, mins, seed=4)
    t = p.tiled()
    args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    for m in (1, 9, 20):
        x = torch.randn(m, 224, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        y32 = ops.quant_linear(x, *args, None, None, torch.float32)
        assert y32.dtype == torch.float32
        assert torch.equal(y32.bfloat16(), ops.quant_linear(x, *args))
        assert not torch.equal(y32, y32.bfloat16().float())  # not rounded to bf16 first
        ref = quantized_activations_reference(x) @ p.dequantize().t()  # (an int8 rounding tie may differ)
        assert (y32 - ref).abs().max().item() <= ref.abs().max().item() * 2e-3
        res = torch.randn(m, 37, generator=torch.Generator().manual_seed(7))
        torch.testing.assert_close(ops.quant_linear(x, *args, res, None, torch.float32), y32 + res, rtol=0, atol=1e-5)
        with pytest.raises(RuntimeError, match="residual must be a contiguous"):
            ops.quant_linear(x, *args, res.bfloat16(), None, torch.float32)
    with pytest.raises(RuntimeError, match="out_dtype must be float32 or bfloat16"):
        ops.quant_linear(x, *args, None, None, torch.float16)

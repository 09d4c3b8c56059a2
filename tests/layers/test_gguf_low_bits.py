"""GGUF's Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 kept in the file's own bytes (vlite/layers/gguf_low_bits.py): on
every ISA build this CPU runs, the kernels' output is gguf.quants' dequantized values times the activations the
kernels multiply (their int8 blocks of 32), within float32 rounding, at every step size."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from vlite.layers import gguf_blocks
from vlite.layers.gguf_blocks import COMPACT
from vlite.layers.packed import PackedTensors, StackedPacked
from vlite.layers.quantization import QuantizationPlan, make_linear
from vlite.model_loader.gguf_quants import to_packed

T = gguf.GGMLQuantizationType
TYPES = ["Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "MXFP4"]
_F16_FIELDS = {"Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": []}
TILE_BYTES_PER_256 = {"Q2_K": 84, "Q3_K": 114, "IQ4_NL": 144, "IQ4_XS": 136, "MXFP4": 136}


def random_gguf(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a GGUF type, [n, row bytes], with finite float16 scales (some zero) and MXFP4 exponents
    that keep every value finite."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[name]:
        vals = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16)
        vals[::7] = 0
        raw[:, off:off + 2] = vals.view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":
        raw[:, 0] = rng.integers(118, 127, size=raw.shape[0])
    return raw.reshape(n, -1)


def _reference(raw: np.ndarray, name: str, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, T[name]).reshape(n, k).astype(np.float32))


def _check_product(ops, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, precise: bool, what: object) -> None:
    """y against float64 (x as the kernels quantize it: their int8 blocks and scales, with the residual row where
    `precise`) @ w.T, within float32 rounding of the terms' magnitudes."""
    q, d, _, _ = ops.quantize_activations(x, precise)
    xq = (q.double() * d.double().repeat_interleave(32, 1)).view(x.shape[0], -1, x.shape[1]).sum(1)
    exact = xq @ w.double().T
    bound = 2e-6 * (xq.abs() @ w.double().abs().T) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all(), (what, ((y.double() - exact).abs() / bound).max().item())


@pytest.mark.parametrize("name", TYPES)
def test_kept_at_the_files_size_with_gguf_values(name):
    n, k = 40, 512
    raw = random_gguf(name, n, k)
    p = to_packed(raw, T[name], (n, k))
    assert p.compact and p.fmt == name.lower() and p.shape == (n, k) and p.nbytes() == raw.nbytes
    t = p.tiled()
    assert sum(x.numel() * x.element_size() for x in (t.qt, t.scales)) == 48 * k // 256 * TILE_BYTES_PER_256[name]
    ref = _reference(raw, name, n, k)
    assert torch.equal(p.dequantize(), ref)
    if name == "Q2_K":  # mins per 16: no q4/q8 form; split only at super-blocks
        with pytest.raises(ValueError, match="Q2_K weight"):
            p.cols(32, 256)
        assert torch.equal(p.cols(256, 512).dequantize(), ref[:, 256:])
    else:
        assert torch.equal(p.converted().dequantize(), ref)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,k", [(40, 512), (3, 256)])
def test_kernels_match_gguf(ops, name, n, k):
    """Every step size (decode, verify, prefill chunks past the kernels' row blocking), float32 and bf16
    activations; the kernels' dequantize (an embedding lookup) is gguf's, bit for bit."""
    raw = random_gguf(name, n, k, seed=n + k)
    ref = _reference(raw, name, n, k)
    t = to_packed(raw, T[name], (n, k)).tiled()
    assert torch.equal(ops.dequantize(t.qt, t.scales, t.mins, t.fmt, t.sub, t.n, torch.float32), ref)
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(ops.dequantize(t.qt, t.scales, t.mins, t.fmt, t.sub, t.n, torch.float32, rows=rows), ref[rows])
    g = torch.Generator().manual_seed(k)
    for m in (1, 2, 5, 9, 16, 40, 130):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g).to(dtype)
            y = ops.quant_linear(x, t.qt, t.scales, t.mins, t.fmt, t.sub, t.n, None, None, torch.float32)
            _check_product(ops, y, x, ref, dtype == torch.float32 and m <= 8, (m, dtype))


@pytest.mark.parametrize("name", TYPES)
def test_rows_same_bits_in_any_step_size(ops, name):
    """A row's output does not depend on how many rows share its call: verify steps equal their 1-row decodes."""
    n, k = 37, 768  # three super-blocks: groups of scales that end short of a whole one
    t = to_packed(random_gguf(name, n, k, seed=3), T[name], (n, k)).tiled()
    args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    for dtype, precise in ((torch.bfloat16, False), (torch.float32, True)):
        x = torch.randn(17, k, generator=torch.Generator().manual_seed(6)).to(dtype)
        alone = torch.cat([ops.quant_linear(x[i:i + 1], *args, None, precise) for i in range(17)])
        for m in (2, 3, 9, 17):
            assert torch.equal(ops.quant_linear(x[:m], *args, None, precise), alone[:m]), (m, dtype, precise)


@pytest.mark.parametrize("name", TYPES)
def test_kernels_tile_as_the_reference(ops, name):
    """The C++ tiler used at load makes the very bytes of gguf_low_bits.tile (numpy), padding rows included; fused
    parts tile as their concatenation."""
    n, k = 37, 512
    raw = random_gguf(name, n, k, seed=11)
    fmt = name.lower()
    qt_ref, st_ref = gguf_blocks.tile(raw, fmt, n, k)
    qt_shape, st_shape, st_dtype = gguf_blocks.tile_shapes(fmt, n, k)
    qt, st = torch.full(qt_shape, 7, dtype=torch.uint8), torch.full(st_shape, 7, dtype=st_dtype)
    ops.tile_gguf(torch.from_numpy(raw), COMPACT[fmt], k, qt, st)
    assert torch.equal(qt, torch.from_numpy(qt_ref))
    assert torch.equal(st.view(torch.uint8), torch.from_numpy(np.ascontiguousarray(st_ref)).view(torch.uint8))
    parts = [to_packed(random_gguf(name, rows, k, seed=rows), T[name], (rows, k)) for rows in (32, 16)]
    a, b = StackedPacked.stack(parts).tiled(), PackedTensors.cat(parts).tiled()
    assert torch.equal(a.qt, b.qt) and torch.equal(a.scales, b.scales)


def test_a_linear_layer_gets_them_for_free():
    """MXFP4 (gpt-oss's experts) and the others through make_linear, as the loader hands them to linear and MoE
    expert layers: the kernels where built, else the dense torch fallback, both gguf's values."""
    k = 256
    for name in TYPES:
        raw = random_gguf(name, 24, k, seed=5)
        layer = make_linear(to_packed(raw, T[name], (24, k)), QuantizationPlan("gguf"), torch.bfloat16)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        ref = _reference(raw, name, 24, k)
        exact = x.double() @ ref.double().T
        err = ((layer(x).double() - exact).abs().max() / exact.abs().max()).item()
        assert err < 3e-2, (name, err)


def test_kernels_reject_bad_layouts(ops):
    t = to_packed(random_gguf("Q3_K", 16, 256), T.Q3_K, (16, 256)).tiled()
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="sub must be 16"):
        ops.quant_linear(x, t.qt, t.scales, None, t.fmt, 32, t.n)
    with pytest.raises(RuntimeError, match="bad tiled weight"):
        ops.quant_linear(x, t.qt[:, :-64].contiguous(), t.scales, None, t.fmt, t.sub, t.n)
    m = to_packed(random_gguf("MXFP4", 16, 64), T.MXFP4, (16, 64)).tiled()
    with pytest.raises(RuntimeError, match="bad tiled scales"):
        ops.quant_linear(torch.randn(1, 64), m.qt, m.scales.view(torch.int8), None, m.fmt, m.sub, m.n)

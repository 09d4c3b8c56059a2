"""GGUF's Q4_0, Q4_K, Q5_K and Q6_K kept in the file's own bytes (vlite/layers/gguf_blocks.py): the
kernels read them at the file's size, on every ISA build this CPU runs, and compute what the file's
values give (a float64 reference) and exactly what the q4/q8 layout of the same values gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from vlite.layers.gguf_blocks import COMPACT
from vlite.layers.packed import PackedTensors, StackedPacked
from vlite.model_loader.gguf_quants import to_packed

T = gguf.GGMLQuantizationType
TYPES = ["Q4_0", "Q4_K", "Q5_K", "Q6_K"]
_F16_FIELDS = {"Q4_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
BITS_PER_WEIGHT = {"Q4_0": 4.5, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}


def random_gguf(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a GGUF type, [n, row bytes], with finite float16 scale fields (some zero)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[name]:
        vals = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16)
        vals[::7] = 0
        raw[:, off:off + 2] = vals.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def _reference(raw: np.ndarray, name: str, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, T[name]).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("name", TYPES)
def test_kept_at_the_files_size(name):
    n, k = 40, 512
    raw = random_gguf(name, n, k)
    p = to_packed(raw, T[name], (n, k))
    assert p.compact and p.fmt == name.lower() and p.shape == (n, k) and p.scales is None
    assert p.nbytes() == raw.nbytes
    t = p.tiled()
    tiled_bytes = sum(x.numel() * x.element_size() for x in (t.qt, t.scales))
    assert tiled_bytes == -(-n // 16) * 16 * k * BITS_PER_WEIGHT[name] / 8  # rows padded to whole tiles
    assert torch.equal(p.dequantize(), _reference(raw, name, n, k))
    converted = p.converted()
    assert not converted.compact and converted.nbytes() > 1.3 * p.nbytes()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,k", [(40, 512), (16, 256), (3, 1024)])
def test_kernels_match_reference(ops, name, n, k):
    """Every step size (decode, verify, prefill chunks), float32 and bf16 activations: the same sums as the
    q4/q8 layout of the same values, bit for bit, and close to float64 arithmetic on the file's values."""
    raw = random_gguf(name, n, k, seed=n + k)
    ref = _reference(raw, name, n, k)
    p = to_packed(raw, T[name], (n, k))
    t, c = p.tiled(), p.converted().tiled()
    assert torch.equal(ops.dequantize(t.qt, t.scales, t.mins, t.fmt, t.sub, t.n, torch.float32), ref)
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(ops.dequantize(t.qt, t.scales, t.mins, t.fmt, t.sub, t.n, torch.float32, rows=rows), ref[rows])
    g = torch.Generator().manual_seed(k)
    for m in (1, 2, 5, 9, 16, 40, 130):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g).to(dtype)
            y = ops.quant_linear(x, t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
            assert torch.equal(y, ops.quant_linear(x, c.qt, c.scales, c.mins, c.fmt, c.sub, c.n)), (m, dtype)
            exact = x.double() @ ref.double().T
            err = ((y.double() - exact).abs().max() / exact.abs().max()).item()
            assert err < (2e-4 if dtype == torch.float32 and m <= 8 else 2e-2), (m, dtype, err)


@pytest.mark.parametrize("name", TYPES)
def test_rows_same_bits_in_any_step_size(ops, name):
    """A row's output does not depend on how many rows share its call (1- and 2-row kernels, passes of 8 or
    16): a speculative verify step's rows equal the 1-row decodes they stand for, float32 rows included."""
    n, k = 37, 768  # three super-blocks: groups of scales that end short of a whole one
    p = to_packed(random_gguf(name, n, k, seed=3), T[name], (n, k))
    t = p.tiled()
    args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)
    for dtype, precise in ((torch.bfloat16, False), (torch.float32, False), (torch.float32, True)):
        x = torch.randn(25, k, generator=torch.Generator().manual_seed(6)).to(dtype)
        alone = torch.cat([ops.quant_linear(x[i:i + 1], *args, None, precise) for i in range(25)])
        for m in (2, 3, 8, 9, 16, 17, 25):
            assert torch.equal(ops.quant_linear(x[:m], *args, None, precise), alone[:m]), (m, dtype, precise)


@pytest.mark.parametrize("name", TYPES)
def test_stacked_parts_tile_as_their_cat(name):
    """Fused QKV / gate-up of one GGUF type: each part tiled into its own rows of one buffer gives the bytes
    of the parts' row-major concatenation tiled; parts that end inside a tile are concatenated instead."""
    k = 512
    parts = [to_packed(random_gguf(name, n, k, seed=n), T[name], (n, k)) for n in (64, 16, 32)]
    stacked = StackedPacked.stack(parts)
    assert isinstance(stacked, StackedPacked) and stacked.shape == (112, k)
    a, b = stacked.tiled(), PackedTensors.cat(parts).tiled()
    assert torch.equal(a.qt, b.qt) and torch.equal(a.scales, b.scales) and (a.fmt, a.sub, a.n) == (b.fmt, b.sub, b.n)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    odd = [parts[0], to_packed(random_gguf(name, 24, k, seed=1), T[name], (24, k))]
    assert isinstance(StackedPacked.stack(odd), PackedTensors)


def test_rows_cols_and_cat_keep_the_blocks():
    n, k = 32, 1024
    raw = random_gguf("Q4_K", n, k, seed=3)
    p = to_packed(raw, T.Q4_K, (n, k))
    ref = p.dequantize()
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert torch.equal(p.rows(idx).dequantize(), ref[idx])
    half = p.cols(256, 768)  # whole super-blocks: still the file's bytes
    assert half.compact and torch.equal(half.dequantize(), ref[:, 256:768])
    split = p.cols(32, 512)  # inside a super-block: the q4 layout of the same values
    assert not split.compact and torch.equal(split.dequantize(), ref[:, 32:512])
    both = PackedTensors.cat([p, p.rows(idx)])
    assert both.compact and torch.equal(both.dequantize(), torch.cat([ref, ref[idx]]))
    six = to_packed(random_gguf("Q6_K", 8, k), T.Q6_K, (8, k))
    with pytest.raises(ValueError, match="different layouts"):
        PackedTensors.cat([p, six])


def test_kernels_reject_bad_compact_layouts(ops):
    p = to_packed(random_gguf("Q6_K", 16, 256), T.Q6_K, (16, 256))
    t = p.tiled()
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="sub must be 16"):
        ops.quant_linear(x, t.qt, t.scales, None, t.fmt, 32, t.n)
    with pytest.raises(RuntimeError, match="bad tiled scales"):
        ops.quant_linear(x, t.qt, t.scales[:, :, :200].contiguous(), None, t.fmt, t.sub, t.n)
    with pytest.raises(RuntimeError, match="bad tiled weight"):
        ops.quant_linear(x, t.qt[:, :-64].contiguous(), t.scales, None, t.fmt, t.sub, t.n)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.quant_linear(torch.randn(1, 128), t.qt, t.scales, None, t.fmt, t.sub, t.n)
    assert set(COMPACT.values()) == {2, 10, 11, 12, 13, 14, 20, 23, 39}


@pytest.mark.parametrize("name", TYPES)
def test_kernels_tile_as_the_reference(ops, name):
    """The C++ tiler used at load makes the very bytes of gguf_blocks.tile (numpy), padding rows included."""
    from vlite.layers import gguf_blocks

    n, k = 37, 512
    raw = random_gguf(name, n, k, seed=11)
    fmt = name.lower()
    qt_ref, st_ref = gguf_blocks.tile(raw, fmt, n, k)
    qt_shape, st_shape, st_dtype = gguf_blocks.tile_shapes(fmt, n, k)
    qt, st = torch.full(qt_shape, 7, dtype=torch.uint8), torch.full(st_shape, 7, dtype=st_dtype)
    ops.tile_gguf(torch.from_numpy(raw), COMPACT[fmt], k, qt, st)
    assert torch.equal(qt, torch.from_numpy(qt_ref))
    assert torch.equal(st.view(torch.uint8), torch.from_numpy(st_ref).view(torch.uint8))

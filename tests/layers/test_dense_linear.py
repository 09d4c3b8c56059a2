"""The dense float32 kernel for steps of a few rows (dense_linear.cpp), on every ISA build this CPU
runs (the `ops` fixture, conftest.py), against torch: x @ w.T + bias + residual; and `linear`, which
takes it for dense float32 weights up to the build's row bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlite import _custom_ops
from vlite.layers.quantization import DenseKernel, dense_kernel, linear


def reference(x, w, bias=None, residual=None):
    out = x.double() @ w.double().t()
    if bias is not None:
        out = out + bias.double()
    return out if residual is None else out + residual.double()


def check(out, ref, k):
    # float32 sums of k products, in another order than float64's
    torch.testing.assert_close(out.double(), ref, atol=1e-6 * k ** 0.5 * ref.abs().max().item(), rtol=1e-5)


# K: whole and partial 16-input steps, and under 16; N: whole blocks of rows (2, 3, 4) and partial last ones
@pytest.mark.parametrize("n,k", [(96, 576), (7, 16), (13, 100), (33, 7), (1, 1)])
def test_matches_torch(ops, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    most = ops.dense_max_rows()
    bias, residual = torch.randn(n, generator=g), torch.randn(most, n, generator=g)
    for m in [m for m in (1, 2, 3, 4, 5, 9, 17, most - 1, most) if 1 <= m <= most]:
        x = torch.randn(m, k, generator=g)
        out = ops.dense_linear(x, w, None, None)
        assert out.shape == (m, n) and out.dtype == torch.float32
        check(out, reference(x, w), k)
        check(ops.dense_linear(x, w, bias, residual[:m]), reference(x, w, bias, residual[:m]), k)


def test_row_bounds_per_build(ops):
    # measured crossovers with torch's GEMM (dense_linear.cpp)
    assert ops.dense_max_rows() == {"avx512": 128, "avx2": 48, "portable": 4}[ops.isa().split("+")[0]]


def test_strided_inputs_and_empty_steps(ops):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(3, 128, generator=g)[:, ::2]  # every other column: not contiguous
    residual = torch.randn(40, 3, generator=g).t()
    assert not x.is_contiguous() and not residual.is_contiguous()
    check(ops.dense_linear(x, w, None, residual), reference(x, w, None, residual), 64)
    assert ops.dense_linear(torch.empty(0, 64), w, None, None).shape == (0, 40)
    with pytest.raises(RuntimeError, match="float32"):
        ops.dense_linear(x.to(torch.bfloat16), w.to(torch.bfloat16), None, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.dense_linear(x.contiguous(), torch.randn(64, 40).t(), None, None)


def test_rows_same_bits_in_any_step_size(ops):
    """A row's output does not depend on the rows beside it: a speculative verify step's rows, or a
    decode in a batch, equal the 1-row decodes they stand for."""
    g = torch.Generator().manual_seed(2)
    most = ops.dense_max_rows()
    w, x = torch.randn(75, 200, generator=g), torch.randn(most, 200, generator=g)
    alone = torch.cat([ops.dense_linear(x[i:i + 1], w, None, None) for i in range(most)])
    for m in [m for m in (2, 3, 5, 9, 16, most) if m <= most]:
        assert torch.equal(ops.dense_linear(x[:m], w, None, None), alone[:m]), m


def test_linear_takes_the_kernel_for_small_float32_steps(ops):
    calls = []

    def run(*args):
        calls.append(args[0].shape[0])
        return ops.dense_linear(*args)

    dense = DenseKernel(run, 3)
    g = torch.Generator().manual_seed(3)
    w, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    for m in (1, 3, 4):
        x, residual = torch.randn(m, 64, generator=g), torch.randn(m, 48, generator=g)
        check(linear(x, w, bias, residual, out_dtype=torch.float32, dense=dense), reference(x, w, bias, residual), 64)
    assert calls == [1, 3]  # 4 rows > max_rows: torch's GEMM
    x = torch.randn(2, 64, generator=g)
    linear(x.to(torch.bfloat16), w.to(torch.bfloat16), dense=dense)  # other dtypes: torch
    linear(x[None], w, dense=dense)  # not [M, K]: torch
    assert calls == [1, 3]
    assert torch.equal(linear(x, w), F.linear(x, w))  # no kernel given: torch


def test_dense_kernel_only_for_float32_and_with_the_kernels(monkeypatch):
    assert dense_kernel(torch.bfloat16) is None
    if _custom_ops.load() is not None:
        assert dense_kernel(torch.float32).max_rows == _custom_ops.load().dense_max_rows()
    monkeypatch.setenv(_custom_ops.ENV_KERNELS, "0")
    assert dense_kernel(torch.float32) is None

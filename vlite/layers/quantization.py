"""Linear layers over block-quantized weights (vlite/layers/packed.py), on vlite's CPU kernels.

Decoding a few requests at a time is bound by reading the weights from memory, so storing them in
4 or 8 bits makes those steps faster. Where the weights come from:

    a quantized GGUF file   its own blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K), unchanged
    --quantization int8     dense weights rounded to q8 blocks of 32, symmetric (as Q8_0)
    --quantization int4     dense weights rounded to q4 blocks of 32, min/max grid (as Q4_1)

Rounding is to nearest (RTN); the accuracy against float32 is measured in tests and
docs/benchmarks.md. The LM head is kept at 8 bits at most: it is the most sensitive matrix.

Every step runs on the integer kernels, prefills included: with the row-tiled kernels, int8 dot
products beat torch's dense bf16 and float32 GEMMs (oneDNN/MKL) at every batch size measured (1 to
512 rows, docs/perf-log.md "kernel crossover"), and no dense copy is kept. A plan may still set
`dense_above` (steps of more tokens multiply by a dense copy, kept with `keep_dense` or dequantized
for that step), e.g. for CPUs whose matrix units make dense GEMMs faster. Without the C++ kernels
the layer keeps only the dense weight, so a model always loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from vlite import _custom_ops
from vlite.config import QUANTIZATION_METHODS
from vlite.layers.packed import QK, PackedTensors, StackedPacked, TiledTensors

logger = logging.getLogger(__name__)


def quantize_int8(weight: torch.Tensor) -> PackedTensors:
    """[N, K] -> q8 blocks of 32, symmetric: w ~= d * q, q in [-127, 127], d float16 (Q8_0's grid)."""
    n, k = weight.shape
    w = weight.float().view(n, k // QK, QK)
    d = (w.abs().amax(dim=-1) / 127.0).to(torch.float16)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    return PackedTensors("q8", q.contiguous(), d.contiguous(), None)


def quantize_int4(weight: torch.Tensor) -> PackedTensors:
    """[N, K] -> q4 blocks of 32 on a min/max grid: w ~= d * q + m, q in 0..15 (Q4_1's grid)."""
    n, k = weight.shape
    w = weight.float().view(n, k // QK, QK)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / 15.0).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :QK // 2] | (q[..., QK // 2:] << 4)
    return PackedTensors("q4", packed.view(n, k // 2).contiguous(), d.contiguous(), m.contiguous())


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T from packed blocks (a bias is added by `linear`), read by the kernels in
    their row-tiled layout (the row-major PackedTensors is not kept)."""

    def __init__(self, packed: PackedTensors | StackedPacked, dtype: torch.dtype, dense_above: Optional[int] = None,
                 keep_dense: bool = False, precise: Optional[bool] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.fmt, self.sub = packed.kernel_fmt, packed.sub
        self.dtype = dtype
        self.dense_above = dense_above
        # int8 activations plus an int8 residual row (~16-bit products); None: for float32 activations
        self.precise = precise
        self.ops = _custom_ops.load()
        self.dense: Optional[torch.Tensor] = None
        if self.ops is None:  # the torch path: only the dense weight
            self.tiled = None
            self.dense = packed.dequantize(torch.float32).to(dtype)
            self._args: tuple = ()
            return
        self.tiled = packed.tiled()
        if keep_dense:
            self.dense = self.dequantize(dtype)
        # The kernel's weight arguments as a plain tuple: read once per call without nn.Module's
        # attribute lookups (121 calls per decode step of the default model).
        t = self.tiled
        self._args = (t.qt, t.scales, t.mins, t.fmt, t.sub, t.n)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.tiled is None:
            return self.dense.to(dtype)
        return dequantize_packed(self.tiled, dtype, out)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                out_dtype: Optional[torch.dtype] = None, precise_rows: Optional[int] = None) -> torch.Tensor:
        """x @ W.T, plus `residual` (a skip connection; the kernels add it in float32 as they write).
        `out_dtype` (float32 for logits): the kernels write their float32 sums as that dtype, where
        x's would round them (bf16 logits ~20 apart by 1/16: near-ties and coarse logprobs).
        `precise_rows`: the row count that gives float32 activations their residual row (`precise`),
        in place of x's: a speculative verify step passes its rows less its drafts, so that every
        request's rows are computed as they are without speculation (the rule turns at
        `precise_max_rows()` rows, where a 9-row verify step of one request would otherwise drop the
        residual row its 1-row decode steps keep, and a greedy output could take another token)."""
        if self.ops is not None and x.dim() == 2 and (self.dense_above is None or x.shape[0] <= self.dense_above):
            # the decode fast path
            if residual is not None and (residual.dtype != (out_dtype or x.dtype) or not residual.is_contiguous()):
                return self.ops.quant_linear(x, *self._args, None, self.precise, out_dtype, precise_rows) + residual
            return self.ops.quant_linear(x, *self._args, residual, self.precise, out_dtype, precise_rows)
        if self.ops is None:
            out = F.linear(x, self.dense)
        else:
            x2d = x.reshape(-1, self.in_features)
            if self.dense_above is not None and x2d.shape[0] > self.dense_above:
                w = self.dense if self.dense is not None else self.dequantize(
                    x.dtype, out=_scratch(self.out_features, self.in_features, x.dtype))
                out = F.linear(x, w)
            else:
                out = self.ops.quant_linear(x2d, *self._args, None, self.precise, out_dtype, precise_rows).view(
                    *x.shape[:-1], self.out_features)
        if out_dtype is not None:
            out = out.to(out_dtype)
        return out if residual is None else out + residual


class ConcatLinear(nn.Module):
    """A fused projection (QKV, gate/up) whose parts differ in GGUF type (Q4_K_M files keep some layers'
    V in Q6_K): each row group runs on its own packed weight, and the outputs are concatenated, so no
    part is dequantized to a dense copy."""

    def __init__(self, parts: list[QuantizedLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        limits = [p.dense_above for p in parts if p.dense_above is not None]
        self.dense_above = min(limits) if limits else None

    def dequantize(self, dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                out_dtype: Optional[torch.dtype] = None, precise_rows: Optional[int] = None) -> torch.Tensor:
        out = torch.cat([p.forward(x, out_dtype=out_dtype, precise_rows=precise_rows) for p in self.parts], dim=-1)
        return out if residual is None else out + residual


LinearWeight = Union[torch.Tensor, QuantizedLinear, ConcatLinear]

_SCRATCH: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}


def _scratch(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """One reused buffer per weight shape for weights dequantized for a single step (layers run one
    at a time): a fresh tensor each time costs more in page faults than the dequantization."""
    key = (n, k, dtype)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(n, k, dtype=dtype)
    return _SCRATCH[key]


def can_quantize(weight: Any) -> bool:
    """The kernels' shape rule: K in whole blocks of 32."""
    return weight.shape[1] % QK == 0


@dataclass(frozen=True)
class QuantizationPlan:
    """How the model's linear layers store their weights, resolved once at load.

    method: None (dense), "gguf" (the file's own quantized blocks where it has them, dense
    elsewhere), "int8" or "int4" (every linear weight quantized at load).
    """

    method: Optional[str]
    dense_above: Optional[int] = None  # steps of more tokens: dense GEMM (None: never)
    keep_dense: bool = False  # keep a dense copy for large steps (memory) instead of dequantizing per step

    def describe(self) -> str:
        if self.method is None:
            return "dense"
        what = "the GGUF file's own quantized blocks" if self.method == "gguf" else f"{self.method} blocks of 32"
        kernels = _custom_ops.load()
        isa = kernels.isa() if kernels is not None else "none: dense torch fallback"
        if self.dense_above is None:
            return f"{what} (kernels: {isa}, every step)"
        large = "dense copy" if self.keep_dense else "dequantized per step"
        return f"{what} (kernels: {isa}); steps of > {self.dense_above} tokens: dense GEMM ({large})"


def plan_quantization(requested: Optional[str], source_quantization: Optional[str], dtype: torch.dtype,
                      dtype_was_auto: bool = True) -> QuantizationPlan:
    """`requested`: None (auto), "none", "int8" or "int4".

    Auto runs a quantized GGUF file on its own blocks unless float32 was asked for explicitly (the
    reference precision: dense weights, token-identical to transformers).
    """
    if requested == "none":
        return QuantizationPlan(None)
    if requested is not None:
        if requested not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, 'none' or None, got {requested!r}")
        return QuantizationPlan(requested)
    if source_quantization is not None and (dtype != torch.float32 or dtype_was_auto):
        return QuantizationPlan("gguf")
    return QuantizationPlan(None)


def make_linear(weight: Union[torch.Tensor, PackedTensors, StackedPacked], plan: QuantizationPlan, dtype: torch.dtype,
                head: bool = False) -> LinearWeight:
    """The layer's weight as the plan says: dense [N, K] in `dtype`, or a QuantizedLinear.

    `head`: the LM head, which --quantization int4 keeps at int8 (the most sensitive matrix).
    """
    packed = weight if isinstance(weight, (PackedTensors, StackedPacked)) else None
    if plan.method is None or (plan.method == "gguf" and packed is None):
        return _dense(weight, dtype)
    if plan.method in QUANTIZATION_METHODS:
        if not can_quantize(weight):
            logger.warning("weight of shape %s stays dense: K must be a multiple of %d", tuple(weight.shape), QK)
            return _dense(weight, dtype)
        dense = _dense(weight, torch.float32)
        packed = quantize_int4(dense) if plan.method == "int4" and not head else quantize_int8(dense)
    # The head's float32 activations keep the residual row at every step size (prompt logprobs score
    # whole prompts): the logits are what the accuracy is measured on (97.9% -> 98.6% top-1, AVX2 path).
    precise = True if head and dtype == torch.float32 else None
    return QuantizedLinear(packed, dtype, dense_above=plan.dense_above, keep_dense=plan.keep_dense, precise=precise)


def dequantize_packed(packed: PackedTensors | TiledTensors, dtype: torch.dtype,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense weight of packed blocks: the C++ kernel (into `out` when given), else plain torch."""
    kernels = _custom_ops.load()
    if kernels is None:
        return (packed.untiled() if isinstance(packed, TiledTensors) else packed).dequantize(dtype)
    t = packed if isinstance(packed, TiledTensors) else packed.tiled()
    return kernels.dequantize(t.qt, t.scales, t.mins, t.fmt, t.sub, t.n, dtype, out=out)


def _dense(weight: Union[torch.Tensor, PackedTensors, StackedPacked], dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, (PackedTensors, StackedPacked)):
        return dequantize_packed(weight, torch.float32).to(dtype)
    return weight.to(dtype).contiguous()


class DenseKernel(NamedTuple):
    """vlite's C++ kernel for dense float32 weights (dense_linear.cpp), held by a layer: in steps of up to
    `max_rows` rows torch's CPU GEMM reads the weights 2-4x slower than the machine streams them, and
    decode steps are bound by that read (SmolLM2-135M float32: 55 -> ~20 ms per token)."""

    run: Callable[..., torch.Tensor]  # (x, w, bias, residual) -> x @ w.T + bias + residual
    max_rows: int  # the build's crossover: above it torch's GEMM is as fast


def dense_kernel(dtype: torch.dtype) -> Optional[DenseKernel]:
    """The dense kernel for a layer of `dtype`, resolved once at load (the loader's lookup costs ~13 us:
    too much for each of a step's ~120 linears). None: other dtypes, or no C++ kernels."""
    ops = _custom_ops.load() if dtype == torch.float32 else None
    return None if ops is None else DenseKernel(ops.dense_linear, ops.dense_max_rows())


def linear(x: torch.Tensor, weight: LinearWeight, bias: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
           precise_rows: Optional[int] = None, dense: Optional[DenseKernel] = None) -> torch.Tensor:
    """x @ W.T (+ bias) (+ residual), as out_dtype if given (quantized weights: see QuantizedLinear, also
    for `precise_rows`, which dense weights ignore). `dense`: the layer's DenseKernel, which takes dense
    float32 weights in steps of few enough rows (x [M, K] float32, M <= its max_rows)."""
    if isinstance(weight, (QuantizedLinear, ConcatLinear)):
        if bias is None:
            return weight.forward(x, residual, out_dtype, precise_rows)
        out = weight.forward(x, out_dtype=out_dtype, precise_rows=precise_rows) + bias
    elif (dense is not None and x.dim() == 2 and x.shape[0] <= dense.max_rows and x.dtype == torch.float32
          and weight.dtype == torch.float32 and out_dtype in (None, torch.float32)
          and (residual is None or residual.dtype == torch.float32)):
        return dense.run(x, weight, bias, residual)  # bias and residual added as the sums are written
    else:
        out = F.linear(x, weight, bias)
        if out_dtype is not None:
            out = out.to(out_dtype)
    return out if residual is None else out + residual

"""A decoder layer's linear weights: dense or packed as the quantization plan says, fused where the
model runs several projections of one input as one matmul (QKV, gate/up)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from vlite import _custom_ops
from vlite.layers.packed import PackedTensors, StackedPacked
from vlite.layers.quantization import ConcatLinear, QuantizationPlan, linear, make_linear

if TYPE_CHECKING:
    from vlite.distributed.parallel_state import TPGroup
    from vlite.lora.layers import LoRALayer

Weight = torch.Tensor | PackedTensors
Weights = dict[str, Weight]  # a loader's output: Hugging Face names -> tensors


def param(t: torch.Tensor) -> nn.Parameter:
    """A frozen parameter (inference only), contiguous for the kernels."""
    return nn.Parameter(t.contiguous(), requires_grad=False)


def fuse_rows(parts: list[Weight]) -> Weight | StackedPacked | list[PackedTensors | StackedPacked]:
    """Stack weights along rows (fused QKV, gate/up): packed when every part shares one layout; packed
    parts of mixed GGUF types (Q4_K_M's Q4_K q/k and Q6_K v) as a list of row groups, one per run of
    parts with one layout (linear_weight runs them as a ConcatLinear); dense otherwise."""
    if all(isinstance(p, PackedTensors) for p in parts):
        groups: list[list[PackedTensors]] = []
        for p in parts:
            if groups and groups[-1][0].layout == p.layout:
                groups[-1].append(p)
            else:
                groups.append([p])
        fused = [StackedPacked.stack(g) for g in groups]
        return fused[0] if len(fused) == 1 else fused
    return torch.cat([p.dequantize() if isinstance(p, PackedTensors) else p.float() for p in parts])


def fast_ops(plan: QuantizationPlan) -> Any:
    """vlite's C++ kernels for norms, rotary and SiLU where the model runs quantized weights (a dense
    model keeps torch's ops: float32 stays the reference computation; its linears alone take
    quantization.dense_kernel in small steps, sums of the same products in another order)."""
    return _custom_ops.load() if plan.method is not None else None


def linear_weight(w: Weight | StackedPacked | list[PackedTensors | StackedPacked], plan: QuantizationPlan,
                  dtype: torch.dtype, head: bool = False) -> nn.Module | nn.Parameter:
    """The weight `vlite.layers.quantization.linear` multiplies by: a QuantizedLinear (a ConcatLinear of
    them for fuse_rows' row groups) or a dense parameter."""
    if isinstance(w, list):
        parts = [make_linear(p, plan, dtype, head=head) for p in w]
        if all(isinstance(p, torch.Tensor) for p in parts):
            return param(torch.cat(parts))
        return ConcatLinear(parts)
    out = make_linear(w, plan, dtype, head=head)
    return out if not isinstance(out, torch.Tensor) else param(out)


def fused_bias(w: Weights, names: list[str], dtype: torch.dtype) -> nn.Parameter:
    """The biases of fused projections, concatenated in the same order as their weights."""
    return param(torch.cat([w[n] for n in names]).to(dtype))


def lora_linear(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor], lora: Optional[LoRALayer],
                residual: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
    """linear() (kwargs: precise_rows, dense) plus the step's LoRA adapters' update of the same input."""
    out = linear(x, weight, bias, residual, **kwargs)
    if lora is not None:
        lora.apply(out, x)
    return out


def output_projection(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                      tp: Optional[TPGroup], lora: Optional[LoRALayer], **kwargs: Any) -> torch.Tensor:
    """A block's row-parallel output projection (attention's o, the MLP's down), the skip connection added.

    Under tensor parallelism each rank multiplies its input columns (and its part of the LoRA update: A's
    columns) and the partial sums are all-reduced; rank 0 alone adds the bias (the caller passes it there
    only) and the skip connection."""
    if tp is not None and not tp.is_driver:
        residual = None
    out = lora_linear(x, weight, bias, lora, residual, **kwargs)
    return out if tp is None else tp.all_reduce(out)

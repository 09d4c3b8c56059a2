from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Normalises in float32 whatever the weights' dtype, as the reference Llama does."""

    def __init__(self, weight: torch.Tensor, eps: float, ops: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        # vlite's C++ kernels (quantized models): one call instead of torch's ~8 CPU ops
        self.ops = ops if ops is not None and weight.shape[-1] % 16 == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        # torch's fused kernel: one op instead of eight; in float32 it is bit-identical to the
        # reference formula weight * (x * rsqrt(mean(x^2) + eps)), half-precision inputs are
        # accumulated in float32.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rms_norm(weight: torch.Tensor, cfg: Any, dtype: torch.dtype, ops: Any = None) -> RMSNorm:
    """An RMSNorm of the model's convention (`cfg`: its ModelArchConfig). Gemma's checkpoints store w
    for a scale of (1 + w): the 1 is added here once, in float32 as transformers adds it."""
    if cfg.norm_unit_offset:
        weight = weight.float() + 1.0
    return RMSNorm(weight.to(dtype), cfg.rms_norm_eps, ops)

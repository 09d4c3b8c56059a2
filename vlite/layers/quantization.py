"""Weight-only int8 / int4 linear layers for CPU (opt-in: `--quantization int8|int4`).

Decoding a few requests at a time is bound by reading the weights from memory, so storing them in
8 or 4 bits makes those steps faster; activations stay in the model dtype and products are
accumulated in float32 by torch's packed kernels:

    int8: per output channel, symmetric      w ~= q * scale                 q in [-127, 127]
    int4: per group of 32 inputs, asymmetric w ~= (q - 8) * scale + zero    q in [0, 15]
          (`torch._weight_int4pack_mm_for_cpu`'s convention)

int4 groups of 32 with a min/max grid are Q4_1's layout: a Q4_1 GGUF tensor requantizes exactly
(checked on every linear weight of the default model). The LM head is kept at int8 in int4 mode:
it is the most sensitive matrix. Rounding is to nearest (RTN); the accuracy against float32 is
measured in tests and docs/benchmarks.md.

With `dense_above`, a layer also keeps its dense weight and uses it for steps of more tokens:
packed kernels win while reading weights dominates (few tokens) and lose once the matmul is
compute bound (vLLM's GGUF layers dispatch the same way).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from vlite.config import QUANTIZATION_METHODS

logger = logging.getLogger(__name__)

INT4_GROUP_SIZE = 32
# Steps of at most this many tokens use packed int4 in the automatic GGUF mode (measured on this
# machine's 2 cores: int4 well ahead at 8 rows, even at 16, behind at 32).
SMALL_STEP_TOKENS = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K], float32 scale [N])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """[N, K] -> (int32 q [N, K] in 0..15, float32 scale [N, K/g], float32 zero [N, K/g])."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(n, k)
    return q, scale, lo + 8.0 * scale


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T, from packed int8 or int4 weights (a bias is added by `linear`)."""

    def __init__(self, weight: torch.Tensor, method: str, dense_above: Optional[int] = None) -> None:
        super().__init__()
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
        self.method = method
        self.out_features, self.in_features = weight.shape
        dtype = weight.dtype
        self.dense_above = dense_above
        self.dense = None if dense_above is None else nn.Parameter(weight, requires_grad=False)
        if method == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale.to(dtype))
        else:
            q, scale, zero = quantize_int4(weight)
            self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q, 1))
            # [K/g, N, 2]: the kernel's layout.
            self.register_buffer("scales_and_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(dtype)
                                 .contiguous())

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these packed values stand for (tests, accuracy reports)."""
        eye = torch.eye(self.in_features, dtype=self.scales_dtype)
        return self._matmul(eye).t().float()

    @property
    def scales_dtype(self) -> torch.dtype:
        return (self.scales if self.method == "int8" else self.scales_and_zeros).dtype

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.method == "int8":
            return torch._weight_int8pack_mm(x2d, self.qweight, self.scales)
        return torch._weight_int4pack_mm_for_cpu(x2d, self.qweight, INT4_GROUP_SIZE, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if self.dense is not None and x2d.shape[0] > self.dense_above:
            return F.linear(x, self.dense)
        return self._matmul(x2d).view(*x.shape[:-1], self.out_features)


LinearWeight = Union[torch.Tensor, QuantizedLinear]


def can_quantize(weight: torch.Tensor, method: str) -> bool:
    """The packed kernels' shape rules (int4: K in groups of 32, N a multiple of 16)."""
    n, k = weight.shape
    if method == "int4":
        return k % INT4_GROUP_SIZE == 0 and n % 16 == 0
    return True


def make_linear(weight: torch.Tensor, method: Optional[str], dense_above: Optional[int] = None) -> LinearWeight:
    """A dense weight (method None, or a shape the kernels refuse) or a QuantizedLinear."""
    if method is None:
        return weight
    if not can_quantize(weight, method):
        logger.warning("weight of shape %s stays dense: %s needs K %% %d == 0 and N %% 16 == 0",
                       tuple(weight.shape), method, INT4_GROUP_SIZE)
        return weight
    return QuantizedLinear(weight, method, dense_above)


@dataclass(frozen=True)
class QuantizationPlan:
    """How the model's linear layers store their weights, resolved once at load."""

    method: Optional[str]  # None: dense
    dense_above: Optional[int] = None  # keep dense weights too, used for steps of more tokens
    quantize_lm_head: bool = True

    def describe(self) -> str:
        if self.method is None:
            return "dense"
        if self.dense_above is None:
            return f"{self.method} weight-only" + (" (LM head int8)" if self.quantize_lm_head else "")
        return f"{self.method} for steps of <= {self.dense_above} tokens, dense above"


def plan_quantization(requested: Optional[str], source_quantization: Optional[str],
                      dtype: torch.dtype) -> QuantizationPlan:
    """`requested`: None (auto), "none", "int8" or "int4".

    Auto keeps a Q4_1 GGUF model's linear layers in their own 4-bit values for small steps (the
    file's exact weights; decoding reads 4x fewer bytes) when running in a half-precision dtype.
    float32 stays dense: it is the reference precision.
    """
    if requested == "none":
        return QuantizationPlan(None)
    if requested is not None:
        return QuantizationPlan(requested)
    if source_quantization == "Q4_1" and dtype != torch.float32:
        return QuantizationPlan("int4", dense_above=SMALL_STEP_TOKENS, quantize_lm_head=False)
    return QuantizationPlan(None)


def linear(x: torch.Tensor, weight: LinearWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if isinstance(weight, QuantizedLinear):
        out = weight.forward(x)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)

"""The gated feed-forward block of Llama-style decoders: down(act(gate(x)) * up(x)), act = SiLU, or
GELU with the tanh approximation (Gemma's gelu_pytorch_tanh); gpt-oss's experts: down(swiglu_oai(gate, up))."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlite.distributed.parallel_state import get_tp_group
from vlite.layers.linear import Weights, fast_ops, fuse_rows, fused_bias, linear_weight, lora_linear, output_projection
from vlite.layers.quantization import QuantizationPlan, dense_kernel
from vlite.model_arch import ModelArchConfig

if TYPE_CHECKING:
    from vlite.lora.layers import LoRALayer


class GatedMLP(nn.Module):
    """Gate and up projections fused into one matmul; SiLU-and-multiply in one C++ call on quantized
    models (GELU runs in torch). Biases where the config has `mlp_bias`."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, intermediate_size: Optional[int] = None, torch_linears: bool = False) -> None:
        """`intermediate_size`: the block's width where it is not the config's (an expert of a mixture);
        `torch_linears`: dense float32 weights always on torch's GEMM, never the dense kernel (SparseMoE's
        experts: the block matches transformers' bit for bit)."""
        super().__init__()
        self.intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_up_weight = linear_weight(
            fuse_rows([w[f"{prefix}.gate_proj.weight"], w[f"{prefix}.up_proj.weight"]]), plan, dtype)
        self.down_weight = linear_weight(w[f"{prefix}.down_proj.weight"], plan, dtype)
        self.gate_up_bias = (fused_bias(w, [f"{prefix}.gate_proj.bias", f"{prefix}.up_proj.bias"], dtype)
                             if cfg.mlp_bias else None)
        # Tensor parallelism: cfg.intermediate_size is this rank's slice; down's partial sums are
        # all-reduced, its bias and the skip connection added by rank 0 alone.
        self.tp = get_tp_group()
        self.down_bias = (fused_bias(w, [f"{prefix}.down_proj.bias"], dtype)
                          if cfg.mlp_bias and (self.tp is None or self.tp.is_driver) else None)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.clamped = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.hidden_act == "swiglu_oai" else None
        self.ops = (fast_ops(plan) if self.intermediate_size % 16 == 0 and not self.gelu and self.clamped is None
                    else None)
        self.dense = None if torch_linears else dense_kernel(dtype)  # float32 weights in steps of a few rows
        # LoRA (vlite.lora.manager sets them): the step's adapters' updates of the gate/up and down projections
        self.gate_up_lora: Optional[LoRALayer] = None
        self.down_lora: Optional[LoRALayer] = None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                precise_rows: Optional[int] = None) -> torch.Tensor:
        """The block's output, plus `residual` (the layer's skip connection) when given; `precise_rows`:
        the step's, for the quantized kernels (TorchSDPAMetadata.precise_rows)."""
        gate_up = lora_linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_lora, precise_rows=precise_rows,
                              dense=self.dense)
        if self.ops is not None:
            act = self.ops.silu_and_mul(gate_up)
        elif self.clamped is not None:
            act = swiglu_oai(gate_up, self.intermediate_size, *self.clamped)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return output_projection(act, self.down_weight, self.down_bias, residual, self.tp, self.down_lora,
                                 precise_rows=precise_rows, dense=self.dense)


def swiglu_oai(gate_up: torch.Tensor, width: int, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of [gate | up] (each `width` wide), in transformers' order of operations:
    gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(gate * alpha)."""
    gate, up = gate_up.split(width, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))

"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 and Qwen3-Next, over per-request state slots:

    q, k, v, z, b, a = x @ [W_qkv; W_z; W_b; W_a].T       one projection (Qwen3-Next's grouped rows put in order)
    q, k, v          = silu(causal_conv1d(q ++ k ++ v))   depthwise, kernel K, the slot's last K-1 inputs before
    beta, g          = sigmoid(b), -exp(A_log) * softplus(a + dt_bias)
    o                = gated_delta_rule(q, k, v, g, beta)  the slot's [Hv, Dk, Dv] state, q/k L2-normalized
    out              = (rms_norm(o) * w * silu(z)) @ W_out.T  (+ the layer's residual)

The layer keeps no KV cache: the runner hands it its state tensors (conv [S, conv_dim, K-1] and delta-rule
[S, Hv, Dk, Dv], float32) and the step's `GDNAttentionMetadata` (each request's rows and slot).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlite.attention.backends.gdn_attn import GDNAttentionMetadata, causal_conv1d, gated_delta_rule, gated_rms_norm
from vlite.distributed.parallel_state import get_tp_group
from vlite.layers.linear import Weights, fuse_rows, linear_weight, lora_linear, output_projection, param
from vlite.layers.quantization import QuantizationPlan, dense_kernel
from vlite.model_arch import ModelArchConfig

State = tuple[torch.Tensor, torch.Tensor]  # a linear-attention layer's (conv state, delta-rule state) tensors


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = cfg.rms_norm_eps
        # [qkv | z | b | a] rows, one matmul
        self.in_weight = linear_weight(fuse_rows([w[f"{prefix}.{n}.weight"] for n in
                                                  ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]), plan, dtype)
        self.conv_weight = param(w[f"{prefix}.conv1d.weight"].float().reshape(self.conv_dim, -1).contiguous())
        self.A = param(-w[f"{prefix}.A_log"].float().exp())  # the decay rate, negated once here
        self.dt_bias = param(w[f"{prefix}.dt_bias"].float())
        self.norm_weight = param(w[f"{prefix}.norm.weight"].float())
        self.out_weight = linear_weight(w[f"{prefix}.out_proj.weight"], plan, dtype)
        self.scale = self.head_k_dim ** -0.5
        self.tp = get_tp_group()
        self.dense = dense_kernel(dtype)

    def forward(self, x: torch.Tensor, state: State, md: GDNAttentionMetadata, precise_rows: Optional[int] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = x.shape[0]
        proj = lora_linear(x, self.in_weight, None, None, precise_rows=precise_rows, dense=self.dense)
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        conv_state, ssm_state = state
        qkv = causal_conv1d(qkv, self.conv_weight, conv_state, md)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b.float())
        g = self.A * F.softplus(a.float() + self.dt_bias)
        o = gated_delta_rule(q.view(T, self.num_k_heads, self.head_k_dim), k.view(T, self.num_k_heads, self.head_k_dim),
                             v.view(T, self.num_v_heads, self.head_v_dim), g, beta, ssm_state, md, self.scale)
        o = gated_rms_norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm_weight, self.eps)
        return output_projection(o.reshape(T, self.value_dim).to(x.dtype), self.out_weight, None, residual, self.tp,
                                 None, precise_rows=precise_rows, dense=self.dense)

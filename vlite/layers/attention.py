"""Self-attention of a decoder layer over the paged KV cache, in steps a model file may override:

    qkv     = x @ [Wq; Wk; Wv].T (+ bias where the config has attention_bias)
    qkv     = qk_norm(qkv)         the plain attention: as projected; Qwen3 (per head) and OLMo 2 (over
                                   all of q and all of k) normalize in place (vlite/models/qwen3.py, olmo2.py)
    q, k, v = rotate(qkv, rope)    whole heads, by the step's tables (C++ in place on the kernels, else
                                   torch); Phi-4-mini's partial and SmolLM3's NoPE layers in their files
    o       = paged_attention(q, k, v) @ Wo.T (+ bias where attention_out_bias; + the layer's residual)

paged_attention scales the scores by `scale` (head_dim ** -0.5; Gemma passes its own), soft-caps them
where `softcap` is given (Gemma 2), adds each head's attention sink to its softmax's denominator where the
config has them (gpt-oss: `{prefix}.sinks`, float32), and lets the query at position p see the keys in
(p - window, p] on a sliding-window layer (the config's `layer_window`: Mistral, Gemma's pattern, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.attention.selector import paged_attention
from vlite.distributed.parallel_state import get_tp_group
from vlite.layers.layernorm import RMSNorm, rms_norm
from vlite.layers.linear import (Weights, fast_ops, fuse_rows, fused_bias, linear_weight, lora_linear,
                                 output_projection, param)
from vlite.layers.quantization import QuantizationPlan, dense_kernel
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_arch import ModelArchConfig

if TYPE_CHECKING:
    from vlite.lora.layers import LoRALayer

Tables = tuple[torch.Tensor, torch.Tensor]  # a step's rotary (cos, signed sin), see CausalLM.rope
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0, scale: Optional[float] = None,
                 softcap: Optional[float] = None, projections: str = "qkv") -> None:
        """`scale`: of the scores (None: head_dim ** -0.5); `softcap`: scores = cap * tanh(scores / cap);
        `projections`: those the layer has, fused in this order (Gemma 4: "q" where it reads another layer's K/V)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.layer = layer
        self.window = cfg.layer_window(layer)  # 0: every key before the query
        self.softcap = softcap
        self.sinks = param(w[f"{prefix}.sinks"].float()) if cfg.attention_sinks else None
        # Fused QKV projection: one matmul instead of three.
        self.qkv_bias = (fused_bias(w, [f"{prefix}.{n}_proj.bias" for n in projections], dtype)
                         if cfg.attention_bias else None)
        self.qkv_weight = linear_weight(fuse_rows([w[f"{prefix}.{n}_proj.weight"] for n in projections]), plan, dtype)
        self.o_weight = linear_weight(w[f"{prefix}.o_proj.weight"], plan, dtype)
        # Tensor parallelism: this rank's heads only (cfg is the rank's); o's partial sums are all-reduced,
        # its bias and the skip connection added by rank 0 alone.
        self.tp = get_tp_group()
        self.o_bias = (fused_bias(w, [f"{prefix}.o_proj.bias"], dtype)
                       if cfg.attention_out_bias and (self.tp is None or self.tp.is_driver) else None)
        # the C++ in-place rotation (whole heads), where the plan runs the kernels
        self.ops = fast_ops(plan) if self.head_dim <= 512 else None
        self.dense = dense_kernel(dtype)  # float32 weights in steps of a few rows
        # LoRA (vlite.lora.manager sets them): the step's adapters' updates of the qkv and o projections
        self.qkv_lora: Optional[LoRALayer] = None
        self.o_lora: Optional[LoRALayer] = None

    def forward(self, rope: Tables, x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention block's output, plus `residual` (the layer's skip connection) when given."""
        precise_rows = attn_metadata.precise_rows
        qkv = lora_linear(x, self.qkv_weight, self.qkv_bias, self.qkv_lora, precise_rows=precise_rows,
                          dense=self.dense)
        q, k, v = self.rotate(self.qk_norm(qkv), rope)
        o = paged_attention(q, k, v, kv_cache, layer_view(attn_metadata, self.layer), self.scale, self.window,
                            self.softcap, self.sinks)
        return output_projection(o.reshape(-1, self.q_size), self.o_weight, self.o_bias, residual, self.tp,
                                 self.o_lora, precise_rows=precise_rows, dense=self.dense)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """The projection [T, q + k + v] before rotary: here as projected (models with q/k norms override)."""
        return qkv

    def rotate(self, qkv: torch.Tensor, rope: Tables) -> QKV:
        """q, k and v [T, heads, head_dim], q and k rotated by position (`rope`: CausalLM.rope's tables)."""
        h, hkv = self.num_heads, self.num_kv_heads
        if self.ops is not None:  # q and k rotated in place, one call
            self.ops.rotary_inplace(qkv, h + hkv, self.head_dim, *rope)
            return self.heads(qkv)
        heads = qkv.view(-1, h + 2 * hkv, self.head_dim)
        qk = RotaryEmbedding.apply(heads[:, :h + hkv], *rope)  # q and k in one go
        return qk[:, :h], qk[:, h:], heads[:, h + hkv:]

    def heads(self, qkv: torch.Tensor) -> QKV:
        """q, k and v of the projection [T, q + k + v] as [T, heads, head_dim] views."""
        h, hkv = self.num_heads, self.num_kv_heads
        heads = qkv.view(-1, h + 2 * hkv, self.head_dim)
        return heads[:, :h], heads[:, h:h + hkv], heads[:, h + hkv:]


def layer_view(attn_metadata: TorchSDPAMetadata, layer: int) -> TorchSDPAMetadata:
    """The step's attention metadata as `layer` reads it: through its KV cache group's block table where the
    model's layers are in several groups (TorchSDPAMetadata.layer_views)."""
    views = getattr(attn_metadata, "layer_views", None)
    return views.get(layer, attn_metadata) if views else attn_metadata


def qk_norms(cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan, dtype: torch.dtype
             ) -> tuple[RMSNorm, RMSNorm]:
    """The RMSNorms of q and k (`{prefix}.q_norm`, `{prefix}.k_norm`) that a model's `qk_norm` step applies."""
    ops = fast_ops(plan)
    return (rms_norm(w[f"{prefix}.q_norm.weight"], cfg, dtype, ops),
            rms_norm(w[f"{prefix}.k_norm.weight"], cfg, dtype, ops))

"""Self-attention of a decoder layer over the paged KV cache, with the options models differ in.

    qkv = x @ [Wq; Wk; Wv].T (+ bias: Qwen2, Llama with attention_bias)
    q, k = RMSNorm per head (Qwen3, Gemma 3: own weights for q and k, before rotary), or over all
           heads of q and all of k (OLMo 2)
    q, k = rotary(q, k)                (Gemma 3: sliding layers get the tables of their own base;
                                        Phi-4-mini: the leading partial_rotary_factor of each head only;
                                        SmolLM3: none on its NoPE layers)
    o    = paged_attention(q, k, v) @ Wo.T (+ bias: Llama with attention_bias, Qwen3 with attention_bias)

paged_attention scales the scores by head_dim ** -0.5, or query_pre_attn_scalar ** -0.5 (Gemma),
soft-caps them where the config says (Gemma 2), and lets the query at position p see the keys in
(p - window, p] on a sliding-window layer.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.attention.selector import paged_attention
from vlite.distributed.parallel_state import get_tp_group
from vlite.layers.layernorm import rms_norm
from vlite.layers.linear import Weights, fast_ops, fuse_rows, fused_bias, linear_weight
from vlite.layers.quantization import QuantizationPlan, linear
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_arch import ModelArchConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = cfg.layer_window(layer)  # 0: every key before the query
        self.softcap = cfg.attn_logit_softcapping
        # Fused QKV projection: one matmul instead of three.
        self.qkv_bias = (fused_bias(w, [f"{prefix}.{n}_proj.bias" for n in "qkv"], dtype)
                         if cfg.attention_bias else None)
        self.qkv_weight = linear_weight(fuse_rows([w[f"{prefix}.{n}_proj.weight"] for n in "qkv"]), plan, dtype)
        self.o_weight = linear_weight(w[f"{prefix}.o_proj.weight"], plan, dtype)
        # Tensor parallelism: this rank's heads only (cfg is the rank's); o's partial sums are all-reduced,
        # its bias and the skip connection added by rank 0 alone.
        self.tp = get_tp_group()
        self.o_bias = (fused_bias(w, [f"{prefix}.o_proj.bias"], dtype)
                       if cfg.attention_out_bias and (self.tp is None or self.tp.is_driver) else None)
        ops = fast_ops(plan)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = rms_norm(w[f"{prefix}.q_norm.weight"], cfg, dtype, ops)
            self.k_norm = rms_norm(w[f"{prefix}.k_norm.weight"], cfg, dtype, ops)
        self.qk_norm_full = cfg.qk_norm_full  # OLMo 2: one norm over all of q, one over all of k
        # Partial rotary (Phi-4-mini) rotates the leading rotary_dim dims of each head, in torch: the C++
        # in-place rotation takes whole heads.
        self.rotary_dim = cfg.rotary_dim
        self.use_rope = layer not in cfg.nope_layers  # SmolLM3's NoPE layers: q and k as projected
        self.ops = ops if self.head_dim <= 512 and self.rotary_dim == self.head_dim else None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention block's output, plus `residual` (the layer's skip connection) when given."""
        h, hkv = self.num_heads, self.num_kv_heads
        precise_rows = attn_metadata.precise_rows
        qkv = linear(x, self.qkv_weight, self.qkv_bias, precise_rows=precise_rows)
        if self.q_norm is not None and self.qk_norm_full:
            q_end = self.q_size
            qkv[:, :q_end] = self.q_norm(qkv[:, :q_end])
            qkv[:, q_end:q_end + self.kv_size] = self.k_norm(qkv[:, q_end:q_end + self.kv_size])
        elif self.q_norm is not None:  # normalized in place: the rotation below then reads q and k as usual
            heads = qkv.view(-1, h + 2 * hkv, self.head_dim)
            heads[:, :h] = self.q_norm(heads[:, :h])
            heads[:, h:h + hkv] = self.k_norm(heads[:, h:h + hkv])
        if not self.use_rope:
            qkv = qkv.view(-1, h + 2 * hkv, self.head_dim)
            q, k = qkv[:, :h], qkv[:, h:h + hkv]
        elif self.ops is not None:  # q and k rotated in place, one call
            self.ops.rotary_inplace(qkv, h + hkv, self.head_dim, *rope)
            qkv = qkv.view(-1, h + 2 * hkv, self.head_dim)
            q, k = qkv[:, :h], qkv[:, h:h + hkv]
        else:
            qkv = qkv.view(-1, h + 2 * hkv, self.head_dim)
            qk = qkv[:, :h + hkv]
            if self.rotary_dim == self.head_dim:
                qk = RotaryEmbedding.apply(qk, *rope)  # q and k in one go
            else:
                r = self.rotary_dim
                qk = torch.cat((RotaryEmbedding.apply(qk[..., :r], *rope), qk[..., r:]), dim=-1)
            q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, h + hkv:]
        o = paged_attention(q, k, v, kv_cache, attn_metadata, self.scale, self.window, self.softcap)
        if self.tp is None:
            return linear(o.reshape(-1, self.q_size), self.o_weight, self.o_bias, residual, precise_rows=precise_rows)
        out = linear(o.reshape(-1, self.q_size), self.o_weight, self.o_bias, residual if self.tp.is_driver else None,
                     precise_rows=precise_rows)
        return self.tp.all_reduce(out)

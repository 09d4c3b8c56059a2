"""Llama-family decoder (Llama, SmolLM, Mistral-style) assembled from vlite.layers.

The model owns no KV state: the runner passes each layer its paged cache tensor and the step's
attention metadata explicitly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata, paged_attention
from vlite.layers.layernorm import RMSNorm
from vlite.layers.quantization import QuantizationPlan, linear, make_linear
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_loader import LlamaArchConfig

Weights = dict[str, torch.Tensor]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _linear_weight(t: torch.Tensor, plan: QuantizationPlan) -> nn.Module | nn.Parameter:
    w = make_linear(t.contiguous(), plan.method, dense_above=plan.dense_above)
    return w if not isinstance(w, torch.Tensor) else _param(w)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, w: Weights, prefix: str, plan: QuantizationPlan) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # Fused QKV projection: one matmul instead of three.
        self.qkv_bias = (_param(torch.cat([w[f"{prefix}.{n}_proj.bias"] for n in "qkv"]))
                         if cfg.attention_bias else None)
        self.qkv_weight = _linear_weight(torch.cat([w[f"{prefix}.{n}_proj.weight"] for n in "qkv"]), plan)
        self.o_weight = _linear_weight(w[f"{prefix}.o_proj.weight"], plan)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        qkv = linear(x, self.qkv_weight, self.qkv_bias).view(-1, self.num_heads + 2 * self.num_kv_heads,
                                                                self.head_dim)
        qk = RotaryEmbedding.apply(qkv[:, :self.num_heads + self.num_kv_heads], *rope)  # q and k in one go
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        o = paged_attention(q, k, v, kv_cache, attn_metadata, self.scale)
        return linear(o.reshape(-1, self.q_size), self.o_weight)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, w: Weights, prefix: str, plan: QuantizationPlan) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        # Fused gate/up projection.
        self.gate_up_weight = _linear_weight(
            torch.cat([w[f"{prefix}.gate_proj.weight"], w[f"{prefix}.up_proj.weight"]]), plan)
        self.down_weight = _linear_weight(w[f"{prefix}.down_proj.weight"], plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_weight).split(self.intermediate_size, dim=-1)
        return linear(F.silu(gate) * up, self.down_weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, w: Weights, i: int, plan: QuantizationPlan) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(w[f"{p}.input_layernorm.weight"], cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, w, f"{p}.self_attn", plan)
        self.post_attention_layernorm = RMSNorm(w[f"{p}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, w, f"{p}.mlp", plan)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None)) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = _param(weights["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, weights, i, plan)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps)
        lm_head = weights.get("lm_head.weight")
        tied = cfg.tie_word_embeddings or lm_head is None
        if plan.method is None or not plan.quantize_lm_head:
            self.lm_head = self.embed_tokens if tied else _param(lm_head)
        else:  # the head is the most sensitive matrix: at most int8 (the embedding stays dense for lookups)
            self.lm_head = _linear_weight(self.embed_tokens if tied else lm_head, QuantizationPlan("int8"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.get_cos_sin(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(rope, hidden, kv_cache, attn_metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()

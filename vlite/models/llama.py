"""Llama-family decoder (Llama, SmolLM, Mistral-style) assembled from vlite.layers.

The model owns no KV state: the runner passes each layer its paged cache tensor and the step's
attention metadata explicitly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlite import _custom_ops
from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata, paged_attention
from vlite.layers.layernorm import RMSNorm
from vlite.layers.packed import PackedTensors
from vlite.layers.quantization import QuantizationPlan, QuantizedLinear, linear, make_linear
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_loader import LlamaArchConfig

Weight = torch.Tensor | PackedTensors
Weights = dict[str, Weight]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _fuse(parts: list[Weight]) -> Weight:
    """Stack weights along rows (fused QKV, gate/up): packed when every part shares one layout."""
    if all(isinstance(p, PackedTensors) for p in parts):
        try:
            return PackedTensors.cat(parts)
        except ValueError:  # mixed GGUF types (e.g. Q4_K and Q6_K): run this layer dense
            pass
    return torch.cat([p.dequantize() if isinstance(p, PackedTensors) else p.float() for p in parts])


def _fast_ops(plan: QuantizationPlan) -> Any:
    """vlite's C++ kernels for norms, rotary and SiLU where the model runs quantized weights (a dense
    model keeps torch's ops: float32 stays bit-for-bit the reference computation)."""
    return _custom_ops.load() if plan.method is not None else None


def _linear_weight(w: Weight, plan: QuantizationPlan, dtype: torch.dtype, head: bool = False
                   ) -> nn.Module | nn.Parameter:
    out = make_linear(w, plan, dtype, head=head)
    return out if not isinstance(out, torch.Tensor) else _param(out)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # Fused QKV projection: one matmul instead of three.
        self.qkv_bias = (_param(torch.cat([w[f"{prefix}.{n}_proj.bias"] for n in "qkv"]).to(dtype))
                         if cfg.attention_bias else None)
        self.qkv_weight = _linear_weight(_fuse([w[f"{prefix}.{n}_proj.weight"] for n in "qkv"]), plan, dtype)
        self.o_weight = _linear_weight(w[f"{prefix}.o_proj.weight"], plan, dtype)
        self.ops = _fast_ops(plan) if self.head_dim <= 512 else None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        if self.ops is not None:  # q and k rotated in place, one call
            self.ops.rotary_inplace(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)
            qkv = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            q, k = qkv[:, :self.num_heads], qkv[:, self.num_heads:self.num_heads + self.num_kv_heads]
        else:
            qkv = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            qk = RotaryEmbedding.apply(qkv[:, :self.num_heads + self.num_kv_heads], *rope)  # q and k in one go
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        o = paged_attention(q, k, v, kv_cache, attn_metadata, self.scale)
        return linear(o.reshape(-1, self.q_size), self.o_weight)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        # Fused gate/up projection.
        self.gate_up_weight = _linear_weight(
            _fuse([w[f"{prefix}.gate_proj.weight"], w[f"{prefix}.up_proj.weight"]]), plan, dtype)
        self.down_weight = _linear_weight(w[f"{prefix}.down_proj.weight"], plan, dtype)
        self.ops = _fast_ops(plan) if self.intermediate_size % 16 == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight)
        if self.ops is not None:
            return linear(self.ops.silu_and_mul(gate_up), self.down_weight)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return linear(F.silu(gate) * up, self.down_weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        ops = _fast_ops(plan)
        self.input_layernorm = RMSNorm(w[f"{p}.input_layernorm.weight"].to(dtype), cfg.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(cfg, w, f"{p}.self_attn", plan, dtype)
        self.post_attention_layernorm = RMSNorm(w[f"{p}.post_attention_layernorm.weight"].to(dtype), cfg.rms_norm_eps,
                                                ops)
        self.mlp = LlamaMLP(cfg, w, f"{p}.mlp", plan, dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self._plan = plan
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        embed = weights["model.embed_tokens.weight"]
        # A quantized embedding stays packed where the plan runs packed weights: a lookup dequantizes
        # just the step's rows (the same values as a dense copy, in a quarter of the memory).
        self.packed_embed = embed if isinstance(embed, PackedTensors) and plan.method is not None else None
        self.embed_tokens = None if self.packed_embed is not None else _param(make_linear(embed, QuantizationPlan(None),
                                                                                         dtype))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, weights, i, plan, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(weights["model.norm.weight"].to(dtype), cfg.rms_norm_eps, _fast_ops(plan))
        # the rotary tables the attention layers take: float32 rows for their in-place C++ rotation
        self.fast_rope = self.layers[0].self_attn.ops is not None
        lm_head = weights.get("lm_head.weight")
        tied = cfg.tie_word_embeddings or lm_head is None
        if plan.method is None:
            self.lm_head = self.embed_tokens if tied else _param(make_linear(lm_head, plan, dtype))
        else:  # the head is the most sensitive matrix: --quantization int4 keeps it at int8
            self.lm_head = _linear_weight(embed if tied else lm_head, plan, dtype, head=True)

        self._fused_layers = self._fused_decode_args()

    def _fused_decode_args(self) -> Optional[list[tuple]]:
        """Per layer, the arguments of the C++ `llama_decode_layer` (all-decode steps in one call per
        layer), where every projection runs packed weights on the kernels; else None."""
        ops = self._fused_ops = _fast_ops(self._plan)
        if ops is None or self.config.head_dim % 16 or self.config.head_dim > 256:
            return None
        out = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight]
            if not all(isinstance(w, QuantizedLinear) and w.ops is not None for w in linears) or mlp.ops is None:
                return None
            packed = [ops.PackedLinear(*w._args) for w in linears]
            out.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        layer.input_layernorm.eps, packed, attn.qkv_bias, attn.num_heads, attn.num_kv_heads,
                        attn.head_dim))
        self._fused_max_tokens = min(w.dense_above or 1 << 30 for layer in self.layers
                                     for w in (layer.self_attn.qkv_weight, layer.mlp.down_weight))
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_embed is not None:
            return self.packed_embed.rows(input_ids).dequantize(torch.float32).to(self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)
        rope = self.rotary.get_cos_sin_f32(positions) if self.fast_rope else self.rotary.get_cos_sin(positions,
                                                                                                       hidden.dtype)
        d = attn_metadata.decode
        if (self._fused_layers is not None and not attn_metadata.prefills and d is not None
                and hidden.shape[0] <= self._fused_max_tokens and hidden.dtype in (torch.float32, torch.bfloat16)):
            # every token a decode: one C++ call per layer
            scale = self.layers[0].self_attn.scale
            for args, kv_cache in zip(self._fused_layers, kv_caches):
                hidden = self._fused_ops.llama_decode_layer(hidden, *args, *rope, kv_cache, attn_metadata.slot_mapping,
                                                            d.block_table, d.seq_lens, scale)
            return self.norm(hidden)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(rope, hidden, kv_cache, attn_metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()

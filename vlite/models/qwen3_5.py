"""Qwen3.5 (dense and MoE; also the text model of its image-text checkpoints): a hybrid of Gated DeltaNet
linear-attention layers (three of every four, `linear_layers`; vlite/layers/gated_deltanet.py) and gated full
attention, each in a pre-norm block with a gated MLP or a mixture with a gated shared expert:

    h = h + mixer(rms_norm(h))       mixer: GatedDeltaNet (recurrent state), or attention below
    h = h + mlp(rms_norm(h))         GatedMLP, or SharedExpertMoE on the mixture's layers

The attention: q_proj yields each head's query and a gate side by side ([q_h | gate_h] per head); q and k are
RMS-normalized per head, the leading quarter of each head rotated (neox halves), and the output scaled by
sigmoid(gate) before o_proj. Every RMSNorm but the DeltaNet's own scales by (1 + weight).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.attention.selector import paged_attention
from vlite.layers.attention import Attention, Tables, layer_view, qk_norms
from vlite.layers.decoder import CausalLM, layer_norms
from vlite.layers.gated_deltanet import GatedDeltaNet
from vlite.layers.linear import Weights, lora_linear, output_projection
from vlite.layers.mlp import GatedMLP
from vlite.layers.moe import SharedExpertMoE, SparseMoE
from vlite.layers.quantization import QuantizationPlan
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_arch import ModelArchConfig


class Qwen3_5Attention(Attention):
    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, w, prefix, plan, dtype, layer)  # rows [q_proj (queries and gates) | k | v]
        self.q_norm, self.k_norm = qk_norms(cfg, w, prefix, plan, dtype)
        self.rotary_dim = cfg.rotary_dim
        self.ops = None  # a partial rotation, in torch (CausalLM then passes torch's tables)

    def forward(self, rope: Tables, x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        precise_rows = attn_metadata.precise_rows
        T, h, hkv, d, r = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim
        qkv = lora_linear(x, self.qkv_weight, self.qkv_bias, self.qkv_lora, precise_rows=precise_rows,
                          dense=self.dense)
        q_gate = qkv[:, :2 * h * d].view(T, h, 2, d)
        gate = q_gate[:, :, 1].reshape(T, h * d)
        q = self.q_norm(q_gate[:, :, 0])
        k = self.k_norm(qkv[:, 2 * h * d:(2 * h + hkv) * d].view(T, hkv, d))
        v = qkv[:, (2 * h + hkv) * d:].view(T, hkv, d)
        qk = torch.cat((q, k), dim=1)
        qk = torch.cat((RotaryEmbedding.apply(qk[..., :r], *rope), qk[..., r:]), dim=-1)
        o = paged_attention(qk[:, :h], qk[:, h:], v, kv_cache, layer_view(attn_metadata, self.layer), self.scale,
                            self.window, self.softcap)
        o = o.reshape(T, h * d) * torch.sigmoid(gate)
        return output_projection(o, self.o_weight, self.o_bias, residual, self.tp, self.o_lora,
                                 precise_rows=precise_rows, dense=self.dense)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = layer_norms(
            cfg, w, i, plan, dtype, "input_layernorm", "post_attention_layernorm")
        self.is_linear = i in cfg.linear_layers
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, w, f"model.layers.{i}.linear_attn", plan, dtype)
        else:
            self.self_attn = Qwen3_5Attention(cfg, w, f"model.layers.{i}.self_attn", plan, dtype, i)
        prefix = f"model.layers.{i}.mlp"
        moe = SharedExpertMoE if cfg.shared_expert_intermediate_size else SparseMoE
        self.mlp = (moe(cfg, w, prefix, plan, dtype) if i in cfg.moe_layers
                    else GatedMLP(cfg, w, prefix, plan, dtype))

    def forward(self, rope: Tables, hidden: torch.Tensor, kv_cache: Any, attn_metadata: TorchSDPAMetadata
                ) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        if self.is_linear:
            hidden = self.linear_attn(x, kv_cache, attn_metadata.gdn, attn_metadata.precise_rows, residual=hidden)
        else:
            hidden = self.self_attn(rope, x, kv_cache, attn_metadata, residual=hidden)
        return self.mlp(self.post_attention_layernorm(hidden), residual=hidden, precise_rows=attn_metadata.precise_rows)


class Qwen3_5ForCausalLM(CausalLM):
    layer_class = Qwen3_5DecoderLayer

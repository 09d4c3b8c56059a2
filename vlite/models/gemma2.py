"""Gemma 2: norms before and after both attention and MLP ("sandwich"), queries scaled by
query_pre_attn_scalar ** -0.5, attention scores and final logits soft-capped, embeddings times
sqrt(hidden_size).

From the config and registry: RMSNorm scaling by (1 + weight) (`norm_unit_offset`: the rms_norm helper
adds the 1; the GGUF loader needs the fact too), a GELU-tanh gated MLP (`hidden_act`), every other layer
(the first included) sliding over `sliding_window` keys (`layer_window`), caps of 50 on the scores
(`attn_logit_softcapping`) and 30 on the logits (`final_logit_softcapping`); the head is tied.

Soft-capped attention runs on torch's einsum path (the C++ decode kernel has no soft-capping).
"""

from __future__ import annotations

import torch
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.layers.attention import Attention, Tables
from vlite.layers.decoder import CausalLM, layer_norms
from vlite.layers.linear import Weights
from vlite.layers.mlp import GatedMLP
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig


def query_scale(cfg: ModelArchConfig) -> float:
    """Gemma's attention scale: query_pre_attn_scalar ** -0.5 (head_dim's where a config has none)."""
    return (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5


class Gemma2Attention(Attention):
    """The shared attention, its scores scaled by `query_scale` and soft-capped at attn_logit_softcapping."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, w, prefix, plan, dtype, layer, scale=query_scale(cfg),
                         softcap=cfg.attn_logit_softcapping)


class Gemma2DecoderLayer(nn.Module):
    """Norms before and after both blocks: h += norm(attn(norm(h))); h += norm(mlp(norm(h))).

    The outputs are normalized before the skip connection is added, so it cannot ride in the output
    projections as in Llama's layer.
    """

    attention_class: type[Attention] = Gemma2Attention

    def __init__(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
         self.post_feedforward_layernorm) = layer_norms(cfg, w, i, plan, dtype, "input_layernorm",
                                                        "post_attention_layernorm", "pre_feedforward_layernorm",
                                                        "post_feedforward_layernorm")
        self.self_attn = self.attention_class(cfg, w, f"model.layers.{i}.self_attn", plan, dtype, i)
        self.mlp = GatedMLP(cfg, w, f"model.layers.{i}.mlp", plan, dtype)

    def forward(self, rope: Tables, hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden), precise_rows=attn_metadata.precise_rows)
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma2ForCausalLM(CausalLM):
    layer_class: type[nn.Module] = Gemma2DecoderLayer

    def __init__(self, cfg: ModelArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, weights, plan, dtype)
        # embeddings times sqrt(hidden_size), the factor rounded to the model's dtype as transformers does
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits soft-capped where the config has final_logit_softcapping: cap * tanh(logits / cap)."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

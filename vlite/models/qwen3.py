"""Qwen3 (dense): Llama's pre-norm layer whose attention RMS-normalizes each head of q and of k, with
weights of its own (q_norm, k_norm: head_dim wide), after the projection and before rotary.

From the config: an explicit `head_dim` (num_heads * head_dim need not equal hidden_size); no biases
unless its attention_bias says so (then on q, k, v and o).

The model is the plain `CausalLM`, not Llama's class: the C++ decode layer has no q/k norm, so quantized
Qwen3 models decode layer by layer (each op still on the kernels).
"""

from __future__ import annotations

from typing import Any

import torch

from vlite.layers.attention import Attention, qk_norms
from vlite.layers.decoder import CausalLM
from vlite.layers.linear import Weights
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig
from vlite.models.llama import LlamaDecoderLayer


class Qwen3Attention(Attention):
    """The shared attention with a per-head q/k RMSNorm step (also Gemma 3's)."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0, **kwargs: Any) -> None:
        super().__init__(cfg, w, prefix, plan, dtype, layer, **kwargs)
        self.q_norm, self.k_norm = qk_norms(cfg, w, prefix, plan, dtype)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        # normalized in place: the rotation then reads q and k as usual
        h, hkv = self.num_heads, self.num_kv_heads
        heads = qkv.view(-1, h + 2 * hkv, self.head_dim)
        heads[:, :h] = self.q_norm(heads[:, :h])
        heads[:, h:h + hkv] = self.k_norm(heads[:, h:h + hkv])
        return qkv


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (h += attn(norm(h)); h += mlp(norm(h))) over `Qwen3Attention`."""

    attention_class = Qwen3Attention


class Qwen3ForCausalLM(CausalLM):
    layer_class = Qwen3DecoderLayer

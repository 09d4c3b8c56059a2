"""SmolLM3: Llama's pre-norm decoder in which some layers apply no rotary (NoPE): those of
`ModelArchConfig.nope_layers` (every fourth by default; config.json's `no_rope_layers`)."""

from __future__ import annotations

import torch

from vlite.layers.attention import QKV, Attention, Tables
from vlite.layers.decoder import CausalLM
from vlite.layers.linear import Weights
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig
from vlite.models.llama import LlamaDecoderLayer


class SmolLM3Attention(Attention):
    """The shared attention; on a NoPE layer q and k go to attention as projected."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, w, prefix, plan, dtype, layer)
        self.use_rope = layer not in cfg.nope_layers

    def rotate(self, qkv: torch.Tensor, rope: Tables) -> QKV:
        return super().rotate(qkv, rope) if self.use_rope else self.heads(qkv)


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    attention_class = SmolLM3Attention


class SmolLM3ForCausalLM(CausalLM):
    """The plain `CausalLM`, not Llama's class: Llama's one-C++-call decode layer always rotates."""

    layer_class = SmolLM3DecoderLayer

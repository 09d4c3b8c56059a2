"""OLMoE: Llama's pre-norm layers (unlike OLMo 2, norms before attention and MLP) with OLMo 2's q/k
RMSNorm over the whole q and k projections and a mixture of experts for every MLP. Configs with
`clip_qkv` are refused when read."""

from __future__ import annotations

import torch
from torch import nn

from vlite.layers.decoder import CausalLM
from vlite.layers.linear import Weights
from vlite.layers.moe import SparseMoE
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig
from vlite.models.llama import LlamaDecoderLayer
from vlite.models.olmo2 import Olmo2Attention


class OlmoeDecoderLayer(LlamaDecoderLayer):
    """h += attn(norm(h)) with `Olmo2Attention`; h += moe(norm(h))."""

    attention_class = Olmo2Attention

    def feed_forward(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                     ) -> nn.Module:
        """The shared `SparseMoE` (softmax router, top-k, renormalized where `norm_topk_prob`) on every layer."""
        return SparseMoE(cfg, w, f"model.layers.{i}.mlp", plan, dtype)


class OlmoeForCausalLM(CausalLM):
    layer_class = OlmoeDecoderLayer

"""Mixtral: Mistral's layers (Llama's pre-norm block; a sliding window on every layer where the config
sets one) with a mixture of experts for every MLP."""

from __future__ import annotations

import torch
from torch import nn

from vlite.layers.decoder import CausalLM
from vlite.layers.linear import Weights
from vlite.layers.moe import SparseMoE
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig
from vlite.models.llama import LlamaDecoderLayer


class MixtralDecoderLayer(LlamaDecoderLayer):
    def feed_forward(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                     ) -> nn.Module:
        """The shared `SparseMoE` on every layer, under Mixtral's checkpoint names (`cfg.moe_prefix`:
        `block_sparse_moe.gate`, experts' `w1`/`w3`/`w2` = gate/up/down, the registry's names for the
        loaders too). Its router always renormalizes the top-k weights (softmax, top-k, divided by their
        sum: the same as a softmax over the top-k logits)."""
        return SparseMoE(cfg, w, f"model.layers.{i}.{cfg.moe_prefix}", plan, dtype)


class MixtralForCausalLM(CausalLM):
    """The plain `CausalLM`, not Llama's class: the C++ decode layer has no mixture of experts."""

    layer_class = MixtralDecoderLayer

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's layers (pre-norm, per-head q/k RMSNorm, explicit
`head_dim`) with a mixture of experts for the MLP on the config's `moe_layers`."""

from __future__ import annotations

import torch
from torch import nn

from vlite.layers.decoder import CausalLM
from vlite.layers.linear import Weights
from vlite.layers.moe import SparseMoE
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig
from vlite.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def feed_forward(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                     ) -> nn.Module:
        """The shared `SparseMoE` (softmax router, top `num_experts_per_tok` of `num_experts`, renormalized
        where `norm_topk_prob`) on `moe_layers`; the layers the config keeps dense (`mlp_only_layers`, those
        off the `decoder_sparse_step` pattern) run the plain gated MLP of `intermediate_size`."""
        if i in cfg.moe_layers:
            return SparseMoE(cfg, w, f"model.layers.{i}.mlp", plan, dtype)
        return super().feed_forward(cfg, w, i, plan, dtype)


class Qwen3MoeForCausalLM(CausalLM):
    layer_class = Qwen3MoeDecoderLayer

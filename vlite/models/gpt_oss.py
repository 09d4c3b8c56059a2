"""gpt-oss (openai/gpt-oss-20b, -120b): Llama's pre-norm layer (vlite/models/llama.py) whose attention has q/k/v/o
biases and a learned sink logit per query head (the shared Attention with `attention_sinks`), sliding-window
(128) and full layers alternating (`layer_types`: the sliding ones in their own KV cache groups, which free the
blocks behind the window), YaRN rope (vlite/layers/rotary_embedding.py), and a mixture of experts for every MLP:
a router with a bias whose weights are a softmax over the chosen k logits, experts with biases and a clamped
SwiGLU (`hidden_act` "swiglu_oai": vlite/layers/mlp.py), all of it the shared SparseMoE.

The checkpoints' stacked (and MXFP4) experts are turned into per-expert weights when loaded
(vlite/model_loader/gpt_oss_weights.py); GGUF files hold them per part, as other mixtures' files do.
"""

from __future__ import annotations

import torch
from torch import nn

from vlite.layers.decoder import CausalLM
from vlite.layers.linear import Weights
from vlite.layers.moe import SparseMoE
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig
from vlite.models.llama import LlamaDecoderLayer


class GptOssDecoderLayer(LlamaDecoderLayer):
    def feed_forward(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                     ) -> nn.Module:
        """The shared `SparseMoE` on every layer: router and experts with biases (`mlp_bias`), the router's
        softmax over its top k logits (`router_topk_softmax`), the experts' clamped SwiGLU."""
        return SparseMoE(cfg, w, f"model.layers.{i}.mlp", plan, dtype)


class GptOssForCausalLM(CausalLM):
    """The plain `CausalLM`, not Llama's class: the C++ decode layer has no sinks nor mixture of experts."""

    layer_class = GptOssDecoderLayer

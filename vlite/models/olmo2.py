"""OLMo 2: norms after attention and after the MLP instead of before them, and q/k RMSNorm over the whole
q and k projections (all heads at once), before rotary. No biases.
"""

from __future__ import annotations

import torch
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.layers.attention import Attention, Tables, qk_norms
from vlite.layers.decoder import CausalLM, layer_norms
from vlite.layers.linear import Weights
from vlite.layers.mlp import GatedMLP
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig


class Olmo2Attention(Attention):
    """The shared attention with a q/k RMSNorm step over all heads of q and all of k (weights q_size and
    kv_size wide; also OLMoE's). Under the kernels the norms run over column slices of the fused QKV
    output (rows strided by the QKV width)."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, w, prefix, plan, dtype, layer)
        self.q_norm, self.k_norm = qk_norms(cfg, w, prefix, plan, dtype)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        q_end = self.q_size
        qkv[:, :q_end] = self.q_norm(qkv[:, :q_end])
        qkv[:, q_end:q_end + self.kv_size] = self.k_norm(qkv[:, q_end:q_end + self.kv_size])
        return qkv


class Olmo2DecoderLayer(nn.Module):
    """Norms after the blocks only: h += norm(attn(h)); h += norm(mlp(h)).

    The outputs are normalized before the skip connection is added, so it cannot ride in the output
    projections as in Llama's layer.
    """

    def __init__(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        self.post_attention_layernorm, self.post_feedforward_layernorm = layer_norms(
            cfg, w, i, plan, dtype, "post_attention_layernorm", "post_feedforward_layernorm")
        self.self_attn = Olmo2Attention(cfg, w, f"model.layers.{i}.self_attn", plan, dtype, i)
        self.mlp = GatedMLP(cfg, w, f"model.layers.{i}.mlp", plan, dtype)

    def forward(self, rope: Tables, hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, attn_metadata))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden, precise_rows=attn_metadata.precise_rows))


class Olmo2ForCausalLM(CausalLM):
    layer_class = Olmo2DecoderLayer

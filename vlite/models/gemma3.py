"""Gemma 3 (text: Gemma3ForCausalLM, the 270M and 1B checkpoints, and the text model of GGUF files):
Gemma 2's sandwich layer whose attention RMS-normalizes each head of q and k (Qwen3's step) and does no
soft-capping, five sliding-window layers to one global (`layer_types`, or `sliding_window_pattern`),
the sliding ones rotating with their own base (`rope_local_base_freq`, 10000, unscaled) and the global
ones with `rope_theta` (and its scaling); head_dim 256 on the real checkpoints.

Global layers read every KV block, so the cache keeps them all (one block table for both kinds).
"""

from __future__ import annotations

from typing import Optional

import torch

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.layers.attention import Tables
from vlite.layers.linear import Weights
from vlite.layers.quantization import QuantizationPlan
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_arch import ModelArchConfig
from vlite.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, query_scale
from vlite.models.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention):
    """Per-head q/k RMSNorm (Qwen3's step, with Gemma's (1 + weight) norms), Gemma's query scale, no
    soft-capping; a sliding layer rotates with the local base's tables, a global one with rope_theta's."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, w, prefix, plan, dtype, layer, scale=query_scale(cfg))

    def forward(self, rope: tuple[Tables, Tables], x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`rope`: the step's (global, local) tables (Gemma3ForCausalLM.rope)."""
        global_rope, local_rope = rope
        return super().forward(local_rope if self.window else global_rope, x, kv_cache, attn_metadata, residual)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's model (embedding scale, final-logit soft-capping where the config caps) over
    `Gemma3DecoderLayer`, with a second rotary for the sliding layers."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: ModelArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, weights, plan, dtype)
        self.local_rotary = (self.rotary if cfg.rope_local_theta is None or not any(cfg.layer_windows) else
                             RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[Tables, Tables]:
        """The tables of both bases, (global, local): each layer's attention takes its own."""
        global_rope = self.tables(self.rotary, positions, dtype)
        if self.local_rotary is self.rotary:
            return global_rope, global_rope
        return global_rope, self.tables(self.local_rotary, positions, dtype)

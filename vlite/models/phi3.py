"""Phi-3 and Phi-4-mini: Llama's pre-norm layer whose checkpoints store q/k/v as one `qkv_proj` and
gate/up as one `gate_up_proj`, with rotary over the leading `partial_rotary_factor` of each head
(Phi-4-mini: 0.75) and Phi-3-mini-4k's sliding window (the config's) on every layer.

The fused tensors are split into the shared layers' q/k/v and gate/up names (views, no copy); the
shared layers fuse them again into the same matmuls. LongRoPE checkpoints run with their short factors
within original_max_position_embeddings (the default max_model_len), with their long factors for every
request when max_model_len is past it (ModelArchConfig.with_max_model_len, rope_scaling.longrope_scaling).
"""

from __future__ import annotations

from typing import Any

import torch

from vlite.layers.attention import QKV, Attention, Tables
from vlite.layers.decoder import CausalLM
from vlite.layers.packed import PackedTensors
from vlite.layers.linear import Weights
from vlite.layers.quantization import QuantizationPlan
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_arch import ModelArchConfig
from vlite.models.llama import LlamaDecoderLayer


def _split_rows(w: Any, sizes: list[int]) -> list[Any]:
    """Row blocks of a dense tensor (views) or of a GGUF file's packed one."""
    if not isinstance(w, PackedTensors):
        return list(torch.split(w, sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [w.rows(torch.arange(s, s + n)) for s, n in zip(starts, sizes)]


def split_fused(cfg: ModelArchConfig, weights: Weights) -> Weights:
    """The weights with each layer's qkv_proj and gate_up_proj under the shared layers' per-projection
    names (rows: q, k, v in that order; gate before up, as transformers' Phi3MLP chunks them and GGUF's
    ffn_up holds them)."""
    out = dict(weights)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        for kind in ("weight", "bias"):
            qkv = out.pop(f"{p}.self_attn.qkv_proj.{kind}", None)
            if qkv is not None:
                for name, part in zip("qkv", _split_rows(qkv, [q, kv, kv])):
                    out[f"{p}.self_attn.{name}_proj.{kind}"] = part
            gate_up = out.pop(f"{p}.mlp.gate_up_proj.{kind}", None)
            if gate_up is not None:
                gate, up = _split_rows(gate_up, [cfg.intermediate_size] * 2)
                out[f"{p}.mlp.gate_proj.{kind}"], out[f"{p}.mlp.up_proj.{kind}"] = gate, up
    return out


class Phi3Attention(Attention):
    """The shared attention; where rotary_dim < head_dim (Phi-4-mini) only the leading rotary_dim dims of
    each head are rotated, in torch: the C++ in-place rotation takes whole heads."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, w, prefix, plan, dtype, layer)
        self.rotary_dim = cfg.rotary_dim
        if self.rotary_dim != self.head_dim:
            self.ops = None  # CausalLM then passes torch's tables (`fast_rope` off)

    def rotate(self, qkv: torch.Tensor, rope: Tables) -> QKV:
        if self.rotary_dim == self.head_dim:
            return super().rotate(qkv, rope)
        h, hkv, r = self.num_heads, self.num_kv_heads, self.rotary_dim
        heads = qkv.view(-1, h + 2 * hkv, self.head_dim)
        qk = heads[:, :h + hkv]
        qk = torch.cat((RotaryEmbedding.apply(qk[..., :r], *rope), qk[..., r:]), dim=-1)
        return qk[:, :h], qk[:, h:], heads[:, h + hkv:]


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention


class Phi3ForCausalLM(CausalLM):
    """The plain `CausalLM` over `Phi3DecoderLayer`, the fused checkpoint tensors split first."""

    layer_class = Phi3DecoderLayer

    def __init__(self, cfg: ModelArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, split_fused(cfg, weights), plan, dtype)

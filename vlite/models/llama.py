"""Llama 1/2/3.x, SmolLM and Mistral (with or without its sliding window): the pre-norm decoder layer

    h = h + attn(rms_norm(h))        the shared Attention: whole-head rotary, q/k/v/o biases where the
    h = h + mlp(rms_norm(h))         config has them; the shared GatedMLP (SiLU)

that Qwen2/3, SmolLM3, Phi-3 and the mixtures OLMoE, Qwen3-MoE and Mixtral build on (with their own
attention, `attention_class`, or feed-forward block, `feed_forward`). Mistral's sliding window is the
config's (`layer_window`), on every layer.

What is Llama's own here: all-decode steps of a quantized model run their decoder layers in one C++
call (`LlamaDecodeStack`, each layer `llama_decode_layer`: the same kernels in the same order as the
layer-by-layer path, no Python between them). Under tensor parallelism that path is bypassed: the
layer-by-layer one all-reduces the row-parallel projections' partial sums.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.layers.attention import Attention, Tables
from vlite.layers.decoder import CausalLM, layer_norms
from vlite.layers.linear import Weights, fast_ops
from vlite.layers.linear import fuse_rows as _fuse  # noqa: F401 (its old home: tests import it from here)
from vlite.layers.mlp import GatedMLP
from vlite.layers.quantization import ConcatLinear, QuantizationPlan, QuantizedLinear
from vlite.model_arch import ModelArchConfig


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: h += attn(rms_norm(h)); h += mlp(rms_norm(h))."""

    attention_class: type[Attention] = Attention

    def __init__(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = layer_norms(
            cfg, w, i, plan, dtype, "input_layernorm", "post_attention_layernorm")
        self.self_attn = self.attention_class(cfg, w, f"model.layers.{i}.self_attn", plan, dtype, i)
        self.mlp = self.feed_forward(cfg, w, i, plan, dtype)

    def feed_forward(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                     ) -> nn.Module:
        """Layer i's feed-forward block: the dense gated MLP (the mixtures of experts override it)."""
        return GatedMLP(cfg, w, f"model.layers.{i}.mlp", plan, dtype)

    def forward(self, rope: Tables, hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        # the skip connections go into the output projections (added in float32 by the quantized kernels)
        hidden = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata, residual=hidden)
        return self.mlp(self.post_attention_layernorm(hidden), residual=hidden, precise_rows=attn_metadata.precise_rows)


class LlamaForCausalLM(CausalLM):
    layer_class = LlamaDecoderLayer

    def __init__(self, cfg: ModelArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, weights, plan, dtype)
        self._fused_layers = self._fused_decode_args()
        # the same layers held once in C++: a step's 30 layers in one call (pybind converted each
        # layer's ~20 arguments again per call: 1-row decode layers 2.34 -> 2.23 ms, AVX2 3.33 -> 3.23)
        self._fused_stack = None
        if self._fused_layers is not None:
            self._fused_stack = self._fused_ops.LlamaDecodeStack()
            for args in self._fused_layers:
                self._fused_stack.add_layer(*args)

    def _fused_decode_args(self) -> Optional[list[tuple]]:
        """Per layer, the arguments of the C++ `LlamaDecodeStack.add_layer` (all-decode steps: every layer
        in one call), where every projection runs packed weights on the kernels and the layer
        has no part the C++ layer lacks (o_proj or MLP biases, an attention of other steps than the
        shared one's, e.g. q/k norms, a sliding window); else None."""
        ops = self._fused_ops = fast_ops(self._plan)
        # under tensor parallelism the layer-by-layer path runs (its projections all-reduce between kernels)
        if self.tp is not None or ops is None or self.config.head_dim % 16 or self.config.head_dim > 256:
            return None
        out = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (attn.o_bias is not None or type(attn) is not Attention or mlp.gate_up_bias is not None
                    or mlp.down_bias is not None or attn.window or attn.softcap is not None):
                return None
            # each projection's packed parts: one, or a ConcatLinear's row groups of mixed GGUF types
            linears = [list(w.parts) if isinstance(w, ConcatLinear) else [w]
                       for w in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight)]
            if not all(isinstance(w, QuantizedLinear) and w.ops is not None for parts in linears for w in parts
                       ) or mlp.ops is None:
                return None
            packed = [[ops.PackedLinear(*w._args, w.precise) for w in parts] for parts in linears]
            out.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        layer.input_layernorm.eps, packed, attn.qkv_bias, attn.num_heads, attn.num_kv_heads,
                        attn.head_dim))
        self._fused_max_tokens = min(w.dense_above or 1 << 30 for layer in self.layers
                                     for w in (layer.self_attn.qkv_weight, layer.mlp.down_weight))
        self._attn_scale = self.layers[0].self_attn.scale  # read per step: no nn.Module attribute lookups
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        if self._fused_layers is None:  # also every non-CPU backend's metadata (no decode group)
            return super().forward(input_ids, positions, kv_caches, attn_metadata)
        d = attn_metadata.decode
        if (attn_metadata.prefills or d is None
                or input_ids.shape[0] > self._fused_max_tokens or self.dtype not in (torch.float32, torch.bfloat16)):
            return super().forward(input_ids, positions, kv_caches, attn_metadata)
        # every token a decode: all layers in one C++ call
        hidden = self.embed(input_ids)
        rope = self.rope(positions, hidden.dtype)
        hidden = self._fused_stack.forward(hidden, *rope, kv_caches, attn_metadata.slot_mapping, d.block_table,
                                           d.seq_lens, self._attn_scale, attn_metadata.precise_rows,
                                           d.num_prefix_blocks)
        return self.norm(hidden)

"""Gemma 4 (text: Gemma4ForCausalLM, the text model of Gemma4ForConditionalGeneration checkpoints; E2B, E4B,
26B-A4B, the dense sizes): Gemma 3's sandwich layer and 5:1 sliding/full pattern, with

  - norms scaling by their weight as is (no 1 + w); values RMS-normalized too (no weight); scores unscaled
    (scale 1: the q/k norms set their size); no attention soft-capping;
  - full-attention layers with heads of their own size (global_head_dim) and KV heads, rotating a quarter of
    each half ("proportional" rope, base rope_theta); their values are the keys' projection where
    attention_k_eq_v; sliding layers rotate whole heads with base rope_local_theta;
  - KV-shared layers (the last num_kv_shared_layers): no k/v projections; they attend over the cache of the
    last earlier layer of their kind (`ModelArchConfig.kv_source`), written by it earlier in the same step,
    and hold no KV pages of their own (vlite.core.kv_cache_interface.kv_cache_groups);
  - per-layer inputs (E2B/E4B): per token and layer, (norm(embeds @ Wp * hidden ** -0.5) + E_pl[token] *
    sqrt(d)) * 2 ** -0.5; each layer then adds norm(proj(gelu(gate(h)) * input)) to its output;
  - every layer's output times its layer_scalar;
  - an optional mixture beside the dense MLP on every layer (26B-A4B): the router reads the layer's
    residual stream (RMS-normalized, times its scale and hidden ** -0.5), its top-k softmax weights are
    renormalized and scaled per expert; the experts read their own pre-norm, and both blocks' outputs are
    normalized before they are summed.

KV-shared layers' MLPs are twice as wide in E2B (use_double_wide_mlp): their width is read off the weights.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.attention.selector import paged_attention
from vlite.layers.attention import Attention, Tables, layer_view
from vlite.layers.decoder import layer_norms
from vlite.layers.layernorm import RMSNorm, rms_norm
from vlite.layers.linear import Weight, Weights, fast_ops, linear_weight, lora_linear, output_projection, param
from vlite.layers.mlp import GatedMLP
from vlite.layers.moe import SparseMoE
from vlite.layers.packed import PackedTensors
from vlite.layers.quantization import QuantizationPlan, linear
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_arch import ModelArchConfig
from vlite.models.gemma2 import Gemma2ForCausalLM


class Gemma4Attention(Attention):
    """q (and k, v where the layer has its own K/V) projected, per-head normalized, rotated; scale 1."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype, layer: int = 0) -> None:
        self.kv_layer = cfg.kv_source(layer)  # whose cache (and KV cache group view) this layer reads
        self.k_eq_v = cfg.attention_k_eq_v and not cfg.layer_window(layer)
        projections = "q" if self.kv_layer != layer else "qk" if self.k_eq_v else "qkv"
        layer_cfg = replace(cfg, head_dim=cfg.layer_head_dim(layer), num_key_value_heads=cfg.layer_kv_heads(layer))
        super().__init__(layer_cfg, w, prefix, plan, dtype, layer, scale=1.0, projections=projections)
        ops = fast_ops(plan)
        self.q_norm = rms_norm(w[f"{prefix}.q_norm.weight"], cfg, dtype, ops)
        self.k_norm = rms_norm(w[f"{prefix}.k_norm.weight"], cfg, dtype, ops) if self.kv_layer == layer else None
        self.v_norm = RMSNorm(torch.ones(self.head_dim, dtype=dtype), cfg.rms_norm_eps, ops)

    def forward(self, rope: tuple[Tables, Tables], x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`rope`: the step's (global, local) tables (Gemma4ForCausalLM.rope)."""
        precise_rows = attn_metadata.precise_rows
        tables = rope[1] if self.window else rope[0]
        qkv = lora_linear(x, self.qkv_weight, self.qkv_bias, self.qkv_lora, precise_rows=precise_rows,
                          dense=self.dense)
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, :self.q_size].reshape(-1, h, d))
        k = v = None
        if self.k_norm is not None:
            k_proj = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(-1, hkv, d)
            v_proj = k_proj if self.k_eq_v else qkv[:, self.q_size + self.kv_size:].reshape(-1, hkv, d)
            v = self.v_norm(v_proj)
            q, k = self._rotate(torch.cat([q, self.k_norm(k_proj)], dim=1), tables)
        else:
            q, _ = self._rotate(q, tables)
        o = paged_attention(q, k, v, kv_cache, layer_view(attn_metadata, self.kv_layer), self.scale, self.window)
        return output_projection(o.reshape(-1, self.q_size), self.o_weight, self.o_bias, residual, self.tp,
                                 self.o_lora, precise_rows=precise_rows, dense=self.dense)

    def _rotate(self, heads: torch.Tensor, tables: Tables) -> tuple[torch.Tensor, torch.Tensor]:
        """heads [T, h (+ hkv), d], contiguous, rotated (in place on the kernels): its q part and its k part."""
        if self.ops is not None:
            self.ops.rotary_inplace(heads.view(heads.shape[0], -1), heads.shape[1], self.head_dim, *tables)
        else:
            heads = RotaryEmbedding.apply(heads, *tables)
        return heads[:, :self.num_heads], heads[:, self.num_heads:]


def expert_rows(t: Weight, e: int, n_experts: int, lo: int = 0, hi: Optional[int] = None) -> Weight:
    """Rows lo:hi of expert e's matrix in a stack: [E, rows, K] (transformers) or [E * rows, K] (a GGUF file's,
    packed in its blocks or dense)."""
    per = t.shape[0] // n_experts if isinstance(t, PackedTensors) or t.dim() == 2 else t.shape[1]
    hi = per if hi is None else hi
    if isinstance(t, PackedTensors):
        return t.rows(torch.arange(e * per + lo, e * per + hi))
    return t.reshape(n_experts, per, -1)[e, lo:hi]


class Gemma4MoE(SparseMoE):
    """Gemma 4's mixture: its router (normalized input, scaled, top-k renormalized, per-expert scales) over
    experts stored stacked (experts.gate_up_proj: each expert's gate rows, then its up rows; experts.down_proj)."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype) -> None:
        gate_up, down, n, e_count = (w[f"{prefix}.experts.gate_up_proj"], w[f"{prefix}.experts.down_proj"],
                                     cfg.moe_intermediate_size, cfg.num_experts)
        experts = {f"{prefix}.moe.gate.weight": w[f"{prefix}.router.proj.weight"]}
        for e in range(e_count):
            experts.update({f"{prefix}.moe.experts.{e}.gate_proj.weight": expert_rows(gate_up, e, e_count, 0, n),
                            f"{prefix}.moe.experts.{e}.up_proj.weight": expert_rows(gate_up, e, e_count, n, 2 * n),
                            f"{prefix}.moe.experts.{e}.down_proj.weight": expert_rows(down, e, e_count)})
        super().__init__(cfg, experts, f"{prefix}.moe", plan, dtype)
        self.norm = RMSNorm(torch.ones(cfg.hidden_size, dtype=dtype), cfg.rms_norm_eps)
        self.router_scale = param(w[f"{prefix}.router.scale"].to(dtype))
        self.root_size = cfg.hidden_size ** -0.5
        self.per_expert_scale = param(w[f"{prefix}.router.per_expert_scale"].float())

    def route_and_run(self, router_input: torch.Tensor, x: torch.Tensor,
                      precise_rows: Optional[int] = None) -> torch.Tensor:
        """The experts' weighted sum on x, routed by router_input (the layer's residual stream)."""
        logits = F.linear(self.norm(router_input) * self.router_scale * self.root_size, self.gate_weight)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids]
        return self.experts_sum(x, weights, ids, precise_rows)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
         self.post_feedforward_layernorm) = layer_norms(cfg, w, i, plan, dtype, "input_layernorm",
                                                        "post_attention_layernorm", "pre_feedforward_layernorm",
                                                        "post_feedforward_layernorm")
        self.self_attn = Gemma4Attention(cfg, w, f"{p}.self_attn", plan, dtype, i)
        width = w[f"{p}.mlp.gate_proj.weight"].shape[0]  # twice intermediate_size on E2B's KV-shared layers
        self.mlp = GatedMLP(cfg, w, f"{p}.mlp", plan, dtype, intermediate_size=width)
        self.moe = Gemma4MoE(cfg, w, p, plan, dtype) if i in cfg.moe_layers else None
        if self.moe is not None:
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2, self.pre_feedforward_layernorm_2 = (
                layer_norms(cfg, w, i, plan, dtype, "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                            "pre_feedforward_layernorm_2"))
        self.per_layer_gate = self.per_layer_projection = None
        if cfg.hidden_size_per_layer_input:
            self.per_layer_gate = linear_weight(w[f"{p}.per_layer_input_gate.weight"], plan, dtype)
            self.per_layer_projection = linear_weight(w[f"{p}.per_layer_projection.weight"], plan, dtype)
            self.post_per_layer_input_norm, = layer_norms(cfg, w, i, plan, dtype, "post_per_layer_input_norm")
        self.layer_scalar = param(w[f"{p}.layer_scalar"].reshape(1).to(dtype))

    def forward(self, rope: tuple[Tables, Tables], hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata, per_layer_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = attn_metadata.precise_rows
        attn = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(hidden), precise_rows=rows)
        if self.moe is not None:
            experts = self.moe.route_and_run(hidden, self.pre_feedforward_layernorm_2(hidden), rows)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        hidden = hidden + self.post_feedforward_layernorm(out)
        if self.per_layer_gate is not None:
            gate = linear(hidden, self.per_layer_gate, precise_rows=rows)
            gated = F.gelu(gate, approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(
                linear(gated, self.per_layer_projection, precise_rows=rows))
        return hidden * self.layer_scalar


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's model (embedding scale, final-logit soft-capping) over `Gemma4DecoderLayer`, with a rotary per
    layer kind and the per-layer inputs."""

    layer_class = Gemma4DecoderLayer

    def __init__(self, cfg: ModelArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, weights, plan, dtype)
        full = next((i for i in range(cfg.num_hidden_layers) if not cfg.layer_window(i)), 0)
        self.rotary = RotaryEmbedding(cfg.layer_head_dim(full), cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.rope_local_theta or cfg.rope_theta, None)
        self.per_layer_size = d = cfg.hidden_size_per_layer_input
        if d:
            # the largest table of E2B (262144 x 35 * 256): kept packed where the file is, rows dequantized per step
            table = weights["model.embed_tokens_per_layer.weight"]
            self.per_layer_embed = table if isinstance(table, PackedTensors) else param(table.to(dtype))
            self.per_layer_embed_scale = torch.tensor(d ** 0.5, dtype=dtype)
            self.per_layer_model_projection = linear_weight(weights["model.per_layer_model_projection.weight"], plan,
                                                            dtype)
            self.per_layer_projection_norm = rms_norm(weights["model.per_layer_projection_norm.weight"], cfg, dtype,
                                                      fast_ops(plan))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[Tables, Tables]:
        """The tables of both layer kinds, (full, sliding): each layer's attention takes its own."""
        return self.tables(self.rotary, positions, dtype), self.tables(self.local_rotary, positions, dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, d]: the context projection of the (scaled) embeddings, normalized, plus each token's
        own per-layer embedding (times sqrt(d)), over sqrt(2)."""
        n, d = self.config.num_hidden_layers, self.per_layer_size
        table = self.per_layer_embed
        rows = (table.rows(input_ids).dequantize(torch.float32).to(self.dtype) if isinstance(table, PackedTensors)
                else F.embedding(input_ids, table))
        token = (rows * self.per_layer_embed_scale).view(-1, n, d)
        context = linear(embeds, self.per_layer_model_projection) * self.config.hidden_size ** -0.5
        return (self.per_layer_projection_norm(context.view(-1, n, d)) + token) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.per_layer_size else None
        rope = self.rope(positions, hidden.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(rope, hidden, kv_cache, attn_metadata, None if per_layer is None else per_layer[:, i])
        return self.norm(hidden)

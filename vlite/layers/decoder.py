"""The decoder-only model around a stack of layers: what every model vlite runs has in common.

    hidden = embed(input_ids)
    for layer: hidden = layer(rope(positions), hidden, kv_cache[layer], attn_metadata)
    logits = lm_head(norm(hidden))         (compute_logits, on the rows that sample only)

A model file (vlite/models/) subclasses `CausalLM` and says what is particular to it: its layer
class, its fast paths. What the config switches on is handled here for every model: embeddings scaled
by sqrt(hidden_size), a second rotary base for sliding-window layers, final-logit soft-capping (Gemma).
The model owns no KV state: the runner passes each layer its paged cache
tensor and the step's attention metadata explicitly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.distributed.parallel_state import get_tp_group
from vlite.layers.attention import Attention
from vlite.layers.layernorm import rms_norm
from vlite.layers.linear import Weights, fast_ops, linear_weight, param
from vlite.layers.moe import feed_forward
from vlite.layers.packed import PackedTensors, TiledTensors
from vlite.layers.quantization import QuantizationPlan, linear, make_linear
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_arch import ModelArchConfig


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h += attn(rms_norm(h)); h += mlp(rms_norm(h)) (Llama, Mistral, Qwen2/3)."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        ops = fast_ops(plan)
        self.input_layernorm = rms_norm(w[f"{p}.input_layernorm.weight"], cfg, dtype, ops)
        self.self_attn = Attention(cfg, w, f"{p}.self_attn", plan, dtype, layer=i)
        self.post_attention_layernorm = rms_norm(w[f"{p}.post_attention_layernorm.weight"], cfg, dtype, ops)
        self.mlp = feed_forward(cfg, w, p, plan, dtype, i)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        # the skip connections go into the output projections (added in float32 by the quantized kernels)
        hidden = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata, residual=hidden)
        return self.mlp(self.post_attention_layernorm(hidden), residual=hidden, precise_rows=attn_metadata.precise_rows)


class SandwichDecoderLayer(nn.Module):
    """Norms before and after both blocks (Gemma 2/3): h += norm(attn(norm(h))); h += norm(mlp(norm(h))).

    The outputs are normalized before the skip connection is added, so it cannot ride in the output
    projections as in `DecoderLayer`.
    """

    def __init__(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        ops = fast_ops(plan)

        def norm(name: str) -> nn.Module:
            return rms_norm(w[f"{p}.{name}.weight"], cfg, dtype, ops)

        self.input_layernorm = norm("input_layernorm")
        self.self_attn = Attention(cfg, w, f"{p}.self_attn", plan, dtype, layer=i)
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.mlp = feed_forward(cfg, w, p, plan, dtype, i)
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden), precise_rows=attn_metadata.precise_rows)
        return hidden + self.post_feedforward_layernorm(mlp)


class PostNormDecoderLayer(nn.Module):
    """Norms after the blocks only (OLMo 2): h += norm(attn(h)); h += norm(mlp(h)).

    As in `SandwichDecoderLayer`, the outputs are normalized before the skip connection is added.
    """

    def __init__(self, cfg: ModelArchConfig, w: Weights, i: int, plan: QuantizationPlan, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        ops = fast_ops(plan)
        self.self_attn = Attention(cfg, w, f"{p}.self_attn", plan, dtype, layer=i)
        self.post_attention_layernorm = rms_norm(w[f"{p}.post_attention_layernorm.weight"], cfg, dtype, ops)
        self.mlp = feed_forward(cfg, w, p, plan, dtype, i)
        self.post_feedforward_layernorm = rms_norm(w[f"{p}.post_feedforward_layernorm.weight"], cfg, dtype, ops)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, attn_metadata))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden, precise_rows=attn_metadata.precise_rows))


class CausalLM(nn.Module):
    """Embedding, `layer_class` decoder layers, final RMSNorm and LM head (tied to the embedding or not)."""

    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self._plan = plan
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3's sliding layers rotate with their own base (unscaled); the others with `rotary`
        self.local_rotary = (RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None)
                             if cfg.rope_local_theta is not None and any(cfg.layer_windows) else None)
        self._local_rope_layers = [self.local_rotary is not None and cfg.layer_window(i) > 0
                                   for i in range(cfg.num_hidden_layers)]
        # Gemma: embeddings times sqrt(hidden_size), the factor rounded to the model's dtype as transformers does
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype) if cfg.scale_embeddings else None
        self.final_logit_softcapping = cfg.final_logit_softcapping
        # Tensor parallelism: the embedding and LM head hold this rank's vocab rows (vlite.model_loader.tp_shard)
        self.tp = get_tp_group()
        embed = weights["model.embed_tokens.weight"]
        # A quantized embedding stays packed where the plan runs packed weights: a lookup dequantizes
        # just the step's rows (the same values as a dense copy, in a quarter of the memory).
        self.packed_embed = embed if isinstance(embed, PackedTensors) and plan.method is not None else None
        self.embed_tokens = None if self.packed_embed is not None else param(make_linear(embed, QuantizationPlan(None),
                                                                                        dtype))
        self.layers = nn.ModuleList(self.layer_class(cfg, weights, i, plan, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = rms_norm(weights["model.norm.weight"], cfg, dtype, fast_ops(plan))
        # the rotary tables the attention layers take: float32 rows for their in-place C++ rotation
        self.fast_rope = self.layers[0].self_attn.ops is not None
        lm_head = weights.get("lm_head.weight")
        tied = cfg.tie_word_embeddings or lm_head is None
        if plan.method is None:
            self.lm_head = self.embed_tokens if tied else param(make_linear(lm_head, plan, dtype))
        else:  # the head is the most sensitive matrix: --quantization int4 keeps it at int8
            self.lm_head = linear_weight(embed if tied else lm_head, plan, dtype, head=True)
        # With the C++ kernels, lookups read the packed embedding in the kernels' tiled layout: for a
        # tied head the very same tensors (no second copy of the largest matrix).
        self.tiled_embed: Optional[TiledTensors] = None
        self._embed_ops = fast_ops(plan) if self.packed_embed is not None else None
        if self._embed_ops is not None:
            head_tiled = getattr(self.lm_head, "tiled", None)
            same = tied and plan.method == "gguf" and isinstance(head_tiled, TiledTensors)  # the file's own blocks
            self.tiled_embed = head_tiled if same else self.packed_embed.tiled()
            self.packed_embed = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp is None:
            return self._embed_rows(input_ids)
        # vocab-parallel: each rank looks up the ids in its range, zeros elsewhere, and the sum is the lookup
        start, end = tp.shard.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= end - start)
        hidden = self._embed_rows(local.masked_fill(outside, 0))
        return tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tiled_embed is not None:
            t = self.tiled_embed
            return self._embed_ops.dequantize(t.qt, t.scales, t.mins, t.fmt, t.sub, t.n, self.dtype, rows=input_ids)
        if self.packed_embed is not None:
            return self.packed_embed.rows(input_ids).dequantize(torch.float32).to(self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, rotary: Optional[RotaryEmbedding] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotary tables, computed once and shared by every layer (of one rope base)."""
        rotary = rotary or self.rotary
        return rotary.get_cos_sin_f32(positions) if self.fast_rope else rotary.get_cos_sin(positions, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        rope = self.rope(positions, hidden.dtype)
        local = self.rope(positions, hidden.dtype, self.local_rotary) if self.local_rotary is not None else rope
        for layer, kv_cache, is_local in zip(self.layers, kv_caches, self._local_rope_layers):
            hidden = layer(local if is_local else rope, hidden, kv_cache, attn_metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head, out_dtype=torch.float32)  # quantized: the kernels' sums, unrounded
        if self.tp is not None:  # vocab-parallel head: every rank gets the whole row
            logits = self.tp.all_gather_last(logits, list(self.tp.shard.vocab_sizes))
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

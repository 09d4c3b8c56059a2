"""The decoder-only model around a stack of layers: what every model vlite runs has in common.

    hidden = embed(input_ids)
    for layer: hidden = layer(rope(positions), hidden, kv_cache[layer], attn_metadata)
    logits = lm_head(norm(hidden))         (compute_logits, on the rows that sample only)

Shared here: the (vocab-parallel, possibly packed) embedding, the rotary tables computed once per step,
the final RMSNorm and the LM head (tied or not, int8 under --quantization int4). The building blocks a
layer is made of are shared too: `Attention` (vlite/layers/attention.py, its steps overridable),
`GatedMLP` (mlp.py), `SparseMoE` (moe.py), `RMSNorm` (layernorm.py).

A model file (vlite/models/) says what is particular to its architecture, in code: its decoder layer
(`layer_class`: the norm placement, its attention and MLP), and where it has them its own embedding
scale, rotary tables, logit soft-capping and fast paths. The model owns no KV state: the runner passes
each layer its paged cache tensor and the step's attention metadata explicitly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlite.attention.backends.torch_sdpa import TorchSDPAMetadata
from vlite.distributed.parallel_state import get_tp_group
from vlite.layers.attention import Tables
from vlite.layers.layernorm import rms_norm
from vlite.layers.linear import Weights, fast_ops, linear_weight, param
from vlite.layers.packed import PackedTensors, TiledTensors
from vlite.layers.quantization import QuantizationPlan, dense_kernel, linear, make_linear
from vlite.layers.rotary_embedding import RotaryEmbedding
from vlite.model_arch import ModelArchConfig


def layer_norms(cfg: ModelArchConfig, w: Weights, layer: int, plan: QuantizationPlan, dtype: torch.dtype,
                *names: str) -> list[nn.Module]:
    """Decoder layer `layer`'s RMSNorms `model.layers.{layer}.{name}`, on the C++ kernels where the plan
    quantizes, scaling by (1 + weight) where the model's convention is so (rms_norm)."""
    ops = fast_ops(plan)
    return [rms_norm(w[f"model.layers.{layer}.{name}.weight"], cfg, dtype, ops) for name in names]


class CausalLM(nn.Module):
    """Embedding, `layer_class` decoder layers, final RMSNorm and LM head (tied to the embedding or not).

    `layer_class(cfg, weights, i, plan, dtype)` builds layer i; its forward(rope, hidden, kv_cache,
    attn_metadata) returns the layer's output hidden states (its skip connections included), and its
    `self_attn` is an `Attention`.
    """

    layer_class: type[nn.Module]  # each model file's decoder layer

    def __init__(self, cfg: ModelArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self._plan = plan
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
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
        attention = [layer.self_attn for layer in self.layers if hasattr(layer, "self_attn")]  # not linear-attention
        self.fast_rope = bool(attention) and all(a.ops is not None for a in attention)
        lm_head = weights.get("lm_head.weight")
        tied = cfg.tie_word_embeddings or lm_head is None
        # XForSequenceClassification: the score head on the last token, no LM head (a pooling model samples none)
        self.score = param(weights["score.weight"].to(dtype)) if cfg.classifier == "score" else None
        if self.score is not None:
            self.lm_head = None
        elif plan.method is None:
            self.lm_head = self.embed_tokens if tied else param(make_linear(lm_head, plan, dtype))
        else:  # the head is the most sensitive matrix: --quantization int4 keeps it at int8
            self.lm_head = linear_weight(embed if tied else lm_head, plan, dtype, head=True)
        self._dense = dense_kernel(dtype)  # a dense float32 head in steps of a few rows
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

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """The step's rotary tables, computed once and passed to every layer (Gemma 3: one pair per base)."""
        return self.tables(self.rotary, positions, dtype)

    def tables(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Tables:
        """`rotary`'s (cos, signed sin) at `positions`: float32 rows for the in-place C++ rotation, else
        [T, 1, D] tables of `dtype` for torch's."""
        return rotary.get_cos_sin_f32(positions) if self.fast_rope else rotary.get_cos_sin(positions, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)
        rope = self.rope(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(rope, hidden, kv_cache, attn_metadata)
        return self.norm(hidden)

    def classify(self, last_token_hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final-norm states of each prompt's last token -> [N, num_labels] logits (the `score` head)."""
        if self.score is None:
            raise NotImplementedError(f"{type(self).__name__} has no sequence-classification head")
        return F.linear(last_token_hidden, self.score)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # quantized: the kernels' sums, unrounded; dense float32: the dense kernel in steps of a few rows
        logits = linear(hidden, self.lm_head, out_dtype=torch.float32, dense=self._dense)
        if self.tp is not None:  # vocab-parallel head: every rank gets the whole row
            logits = self.tp.all_gather_last(logits, list(self.tp.shard.vocab_sizes))
        return logits

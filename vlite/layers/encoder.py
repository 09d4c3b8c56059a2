"""The parts BERT-style encoders share (BERT, RoBERTa, XLM-RoBERTa): embeddings of word, absolute position and
token type, post-LayerNorm layers of bidirectional self-attention with biases and a GELU (erf) MLP, over the
flat tokens of a step's whole sequences, padded nowhere.

Attention runs one SDPA call per distinct sequence length of the step: the model reorders the step's tokens
once so that sequences of one length lie together (`EncoderAttentionMetadata.order`), every layer then views
each group as [n, heads, L, head_dim] without gathering, and the hidden states go back to the step's order at
the end. Measured with MiniLM's shapes (12 heads of 32, 256 sequences of 5-40 tokens, 2 threads), per layer:
a loop of per-sequence SDPA calls ~110-170 ms, equal-length groups gathered per layer 47 ms (float32) / 17-33 ms
(bf16), groups of the pre-sorted order 34 / 27-32 ms, block-diagonal masks over 128-token packs 121 / 41 ms,
nested (jagged) tensors 320 ms / 2.3 s (CPU math fallback).

    step: [a a a | b b | c c c]   lengths 3, 2, 3
    order: a a a c c c b b        groups (start 0, 2 sequences of 3), (start 6, 1 sequence of 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vlite.layers.linear import Weights, fuse_rows, fused_bias, linear_weight, param
from vlite.layers.quantization import QuantizationPlan, linear
from vlite.model_arch import ModelArchConfig

__all__ = ["EncoderAttentionMetadata", "Encoder", "LayerNorm", "EncoderLayer", "Dense", "ClassificationHead",
           "GELU_APPROXIMATIONS"]

# transformers' hidden_act names of the GELUs encoders use -> the approximation (F.gelu's and oneDNN's name).
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

# oneDNN's linear with a fused post-op (torch.ops.mkldnn._linear_pointwise, what torch.compile emits for a CPU
# linear): the bias and the GELU, or the residual, applied to the float32 sums in the GEMM's own pass before they
# are rounded to the activations' dtype. Measured with MiniLM's MLP ([6000, 384] @ [1536, 384]^T, bf16, 2 Zen 4
# threads): F.linear then F.gelu 32 ms, fused 19 ms; a plain linear 17.1 -> 16.4 ms. None without oneDNN.
_ONEDNN_LINEAR = (getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available()
                  else None)
# The dtypes it runs here: bf16 only where oneDNN has a bf16 path on this CPU (AVX-512 BW or newer; an AVX2-only
# CPU given dtype bfloat16 gets F.linear, which converts).
_ONEDNN_DTYPES = frozenset() if _ONEDNN_LINEAR is None else frozenset(
    [torch.float32] + ([torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else []))


@dataclass
class EncoderAttentionMetadata:
    """A step of an encoder: whole sequences, flat. query_start_loc [R + 1] (host ints): where each starts."""

    query_start_loc: np.ndarray | torch.Tensor
    max_seq_len: int = 0  # informational (the longest sequence of the step)

    @classmethod
    def from_seq_lens(cls, seq_lens: list[int] | np.ndarray) -> EncoderAttentionMetadata:
        lens = np.asarray(seq_lens, dtype=np.int64)
        return cls(np.concatenate([[0], np.cumsum(lens)]), int(lens.max()) if lens.size else 0)

    @cached_property
    def _plan(self) -> tuple[Optional[torch.Tensor], list[tuple[int, int, int]]]:
        qsl = np.asarray(self.query_start_loc, dtype=np.int64)
        lens = np.diff(qsl)
        by_len = np.argsort(lens, kind="stable")
        groups, start = [], 0
        for length, count in zip(*np.unique(lens, return_counts=True)):
            if length:
                groups.append((start, int(count), int(length)))
            start += int(count * length)
        if np.all(by_len == np.arange(lens.size)):
            return None, groups  # already in length order: no reordering
        order = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in by_len])
        return torch.from_numpy(order), groups

    @property
    def order(self) -> Optional[torch.Tensor]:
        """[T] the step's tokens in the order the layers run them (sequences sorted by length); None: as given."""
        return self._plan[0]

    @property
    def groups(self) -> list[tuple[int, int, int]]:
        """(first row in `order`, sequences, length) per distinct length, ascending."""
        return self._plan[1]


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, in the activations' dtype (as transformers runs BERT's)."""

    def __init__(self, w: Weights, prefix: str, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(w[f"{prefix}.weight"].to(dtype))
        self.bias = param(w[f"{prefix}.bias"].to(dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Dense(nn.Module):
    """x @ W.T + b, W dense or quantized as the plan says; `prefix`.weight / `prefix`.bias; then `activation` (a
    GELU_APPROXIMATIONS key) or plus a residual. Dense weights on the CPU run oneDNN's fused linear."""

    def __init__(self, w: Weights, prefix: str, plan: QuantizationPlan, dtype: torch.dtype,
                 activation: Optional[str] = None) -> None:
        super().__init__()
        self.weight = linear_weight(w[f"{prefix}.weight"], plan, dtype)
        self.bias = fused_bias(w, [f"{prefix}.bias"], dtype)
        self.gelu = None if activation is None else GELU_APPROXIMATIONS[activation]

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.weight
        if isinstance(w, torch.Tensor) and x.dtype in _ONEDNN_DTYPES and x.device.type == "cpu" and x.dim() == 2:
            x = x.contiguous()
            if self.gelu is not None:
                return _ONEDNN_LINEAR(x, w, self.bias, "gelu", [], self.gelu)
            if residual is not None:
                return _ONEDNN_LINEAR.binary(x, residual.contiguous(), w, self.bias, "add")
            return _ONEDNN_LINEAR(x, w, self.bias, "none", [], "")
        if self.gelu is not None:
            return F.gelu(linear(x, w, self.bias), approximate=self.gelu)
        return linear(x, w, self.bias, residual)


class ClassificationHead(nn.Module):
    """logits = out(tanh(dense(h))) on first-token states: BERT's pooler + classifier, RoBERTa's
    classification head, by their checkpoints' names."""

    def __init__(self, w: Weights, dense: str, out: str, plan: QuantizationPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Dense(w, dense, plan, dtype)
        self.out = Dense(w, out, plan, dtype)

    def forward(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first_token_hidden)))


class EncoderAttention(nn.Module):
    """Bidirectional multi-head self-attention: fused q/k/v projection with biases, one SDPA call per group of
    equal-length sequences (scale head_dim ** -0.5), output projection (bias) plus the residual."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype) -> None:
        super().__init__()
        names = [f"{prefix}.self.{n}" for n in ("query", "key", "value")]
        self.qkv_weight = linear_weight(fuse_rows([w[f"{n}.weight"] for n in names]), plan, dtype)
        self.qkv_bias = fused_bias(w, [f"{n}.bias" for n in names], dtype)
        self.out = Dense(w, f"{prefix}.output.dense", plan, dtype)
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim

    def forward(self, x: torch.Tensor, groups: list[tuple[int, int, int]]) -> torch.Tensor:
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        width = self.num_heads * self.head_dim
        out = x.new_empty(x.shape[0], width)
        for start, n, length in groups:
            rows = slice(start, start + n * length)
            q, k, v = qkv[rows].view(n, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v)  # [n, heads, L, head_dim]
            out[rows].view(n, length, self.num_heads, self.head_dim).copy_(o.transpose(1, 2))  # one copy, in place
        return self.out(out, residual=x)


class EncoderLayer(nn.Module):
    """BERT's post-LN layer: h = LN(x + attention(x)); out = LN(h + W2 gelu(W1 h))."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attention = EncoderAttention(cfg, w, f"{prefix}.attention", plan, dtype)
        self.attention_norm = LayerNorm(w, f"{prefix}.attention.output.LayerNorm", eps, dtype)
        self.intermediate = Dense(w, f"{prefix}.intermediate.dense", plan, dtype, activation=cfg.hidden_act)
        self.output = Dense(w, f"{prefix}.output.dense", plan, dtype)
        self.output_norm = LayerNorm(w, f"{prefix}.output.LayerNorm", eps, dtype)

    def forward(self, x: torch.Tensor, groups: list[tuple[int, int, int]]) -> torch.Tensor:
        h = self.attention_norm(self.attention(x, groups))
        return self.output_norm(self.output(self.intermediate(h), residual=h))


class Encoder(nn.Module):
    """Embeddings (word + token type, then absolute position at position + `position_offset`; LayerNorm) and
    the layers. forward() over a step's flat tokens of whole sequences returns the last hidden states [T, H],
    in the step's order; `classify` (heads of subclasses) maps first-token states to logits."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, plan: QuantizationPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.word_embeddings = param(w["embeddings.word_embeddings.weight"].to(dtype))
        self.position_embeddings = param(w["embeddings.position_embeddings.weight"].to(dtype))
        self.token_type_embeddings = (param(w["embeddings.token_type_embeddings.weight"].to(dtype))
                                      if cfg.type_vocab_size else None)
        self.embeddings_norm = LayerNorm(w, "embeddings.LayerNorm", cfg.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(EncoderLayer(cfg, w, f"encoder.layer.{i}", plan, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.position_offset = cfg.position_offset
        self.head: Optional[ClassificationHead] = None  # sequence-classification models: set by their class

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              token_type_ids: Optional[torch.Tensor]) -> torch.Tensor:
        x = F.embedding(input_ids, self.word_embeddings)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:  # transformers' default: every token of type 0
                x = x + self.token_type_embeddings[0]
            else:
                x = x + F.embedding(token_type_ids, self.token_type_embeddings)
        x = x + F.embedding(positions + self.position_offset, self.position_embeddings)
        return self.embeddings_norm(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                attn_metadata: EncoderAttentionMetadata,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions, token_type_ids [T]: the step's sequences one after another, each whole
        (positions 0..len-1); kv_caches: unused (encoders keep none). Returns [T, hidden_size]."""
        order = attn_metadata.order
        if order is not None:
            input_ids, positions = input_ids[order], positions[order]
            token_type_ids = None if token_type_ids is None else token_type_ids[order]
        x = self.embed(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, attn_metadata.groups)
        return x if order is None else torch.empty_like(x).index_copy_(0, order, x)

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, num_labels] logits (models with a sequence-classification head)."""
        if self.head is None:
            raise NotImplementedError(f"{type(self).__name__} has no classification head")
        return self.head(first_token_hidden)

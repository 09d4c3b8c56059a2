"""Tensor-parallel sharding plans and weight shards (no processes): heads by KV group, replicated KV
heads, block-aligned packed columns, and shards that put the checkpoint back together."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vlite.layers.packed import PackedTensors
from vlite.layers.quantization import quantize_int4, quantize_int8
from vlite.model_arch import ModelArchConfig
from vlite.model_loader.hf_config import arch_from_hf_config
from vlite.model_loader.tp_shard import plan_tp, shard_arch, shard_weight


def _arch(**overrides: Any) -> ModelArchConfig:
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    config.update(overrides)
    return arch_from_hf_config(config)


def test_default_model_shape_splits_by_kv_group():
    """SmolLM2-135M's 9 query heads over 3 KV heads cannot split evenly on 2 ranks: whole KV groups go
    to each rank (3+1 and 6+2 heads), so every rank keeps the model's group size of 3."""
    a, b = plan_tp(_arch(), 2)
    assert (a.q_heads, a.kv_heads, b.q_heads, b.kv_heads) == ((0, 3), (0, 1), (3, 9), (1, 3))
    assert (a.intermediate, b.intermediate) == ((0, 768), (768, 1536))
    assert (a.vocab, b.vocab, a.vocab_sizes) == ((0, 500), (500, 1000), (500, 500))
    local = shard_arch(_arch(), b)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (6, 2, 768)
    assert local.vocab_size == 1000 and local.head_dim == 64  # logits are gathered to the full vocabulary


def test_fewer_kv_heads_than_ranks_are_replicated():
    shards = plan_tp(_arch(num_attention_heads=8, num_key_value_heads=2), 4)
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.vocab for s in plan_tp(_arch(vocab_size=1001), 2)] == [(0, 500), (500, 1001)]


@pytest.mark.parametrize("overrides,world,message", [
    (dict(num_attention_heads=8, num_key_value_heads=2), 3, "cannot be replicated evenly"),
    (dict(num_attention_heads=2, num_key_value_heads=1), 4, "exceeds the model's 2 attention heads"),
    (dict(intermediate_size=64), 4, "too large for intermediate_size=64"),
])
def test_unsplittable_models_are_refused_with_the_reason(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        plan_tp(_arch(**overrides), world)


def test_unsupported_family_is_refused():
    arch = _arch(architectures=["Gemma2ForCausalLM"], query_pre_attn_scalar=64, head_dim=64)
    with pytest.raises(ValueError, match="gemma2 models are not supported under tensor parallelism"):
        plan_tp(arch, 2)


@pytest.mark.parametrize("quantize", [quantize_int4, quantize_int8])
def test_packed_columns_keep_every_value(quantize):
    w = quantize(torch.randn(20, 256))
    part = w.cols(64, 192)
    assert part.shape == (20, 128)
    torch.testing.assert_close(part.dequantize(), w.dequantize()[:, 64:192], rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiples of the block size 32"):
        w.cols(16, 192)


def test_shards_put_the_checkpoint_back_together():
    """Concatenating every rank's shard gives the full weight back: rows for column-parallel layers
    (q by heads, k/v by KV heads), columns for row-parallel ones, vocab rows for the embedding."""
    arch = _arch(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, head_dim=32, intermediate_size=128,
                 vocab_size=10)
    shards = plan_tp(arch, 2)
    full = {"model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(64, 128),
            "model.layers.0.self_attn.o_proj.weight": quantize_int8(torch.randn(128, 128)),
            "model.layers.0.mlp.up_proj.weight": torch.randn(128, 128),
            "model.layers.0.mlp.down_proj.weight": quantize_int4(torch.randn(128, 128)),
            "model.embed_tokens.weight": torch.randn(10, 128),
            "model.layers.0.input_layernorm.weight": torch.randn(128)}
    for name, w in full.items():
        parts = [shard_weight(name, w, arch, s) for s in shards]
        dense = [p.dequantize() if isinstance(p, PackedTensors) else p for p in parts]
        whole = w.dequantize() if isinstance(w, PackedTensors) else w
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        if name.endswith("norm.weight"):  # replicated
            assert all(p is w for p in parts)
        else:
            assert dense[0].shape[dim] == whole.shape[dim] // 2, name
            torch.testing.assert_close(torch.cat(dense, dim=dim), whole, rtol=0, atol=0)

"""KV cache sizing from --gpu-memory-utilization: the formula on a faked GPU, and the error when
nothing is left for the cache."""

from __future__ import annotations

import pytest
import torch

from vlite.model_loader import ModelArchConfig
from vlite.model_loader.hf_config import arch_from_hf_config
from vlite.worker import gpu_memory
from vlite.worker.cuda_graphs import capture_sizes

GIB = 2 ** 30


def _arch() -> ModelArchConfig:
    return arch_from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6})


def test_kv_cache_gets_what_utilization_leaves(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))  # 10 GiB in use
    weights = {"a": torch.empty(1000, 1000), "b": torch.empty(10)}
    arch = _arch()
    act = gpu_memory.activation_bytes(arch, torch.bfloat16, 2048, 64)
    kv = gpu_memory.kv_cache_bytes_from_gpu_memory(arch, weights, torch.bfloat16, 0.9, 2048, 64)
    assert kv == int(80 * GIB * 0.9) - 10 * GIB - 1_000_010 * 2 - act
    assert act > 2048 * (4 + 2 * 2) * 16 * 2 + 64 * 1000 * 4  # qkv and residuals at the budget, float32 logits


def test_no_room_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 80 * GIB))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 of 80.0 GiB leaves no room"):
        gpu_memory.kv_cache_bytes_from_gpu_memory(_arch(), {}, torch.bfloat16, 0.5, 2048, 64)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]

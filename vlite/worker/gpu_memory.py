"""The KV cache's share of a GPU: what --gpu-memory-utilization leaves after weights and activations.

    budget   = total * gpu_memory_utilization
    kv_cache = budget - used now (other processes, this one's CUDA context) - weights - activation reserve

Weights are counted dense in the model's dtype (what they become on the GPU, a quantized GGUF file
dequantized); the activation reserve is an estimate of one step's widest intermediates at the token
budget plus the sampler's float32 logits, with a fixed margin for cuBLAS workspaces and the CUDA
graphs' pool. Measured at start-up, before the weights move to the GPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vlite.model_loader import ModelArchConfig

_MARGIN_BYTES = 1 << 30  # cuBLAS/Triton workspaces, CUDA-graph pool, allocator fragmentation


def weight_bytes(weights: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes of the weights once dense in `dtype` (packed GGUF blocks counted by their dense shape)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(w.shape) for w in weights.values()) * elem


def activation_bytes(arch: ModelArchConfig, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """One step's live intermediates: a layer's widest tensors at the token budget (QKV, gate/up and their
    product, residual), the logits of every sampled row in float32 with the sampler's copies, and the margin."""
    elem = torch.empty((), dtype=dtype).element_size()
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    mlp = 3 * max(arch.intermediate_size, arch.moe_intermediate_size * arch.num_experts_per_tok)
    per_token = (qkv + mlp + 4 * arch.hidden_size) * elem
    logits = 4 * max_num_seqs * arch.vocab_size * 4
    return max_num_batched_tokens * per_token + logits + _MARGIN_BYTES


def kv_cache_bytes_from_gpu_memory(arch: ModelArchConfig, weights: dict[str, Any], dtype: torch.dtype,
                                   utilization: float, max_num_batched_tokens: int, max_num_seqs: int,
                                   device: int | str | torch.device = 0) -> int:
    """The KV cache's bytes on `device` (see the module docstring); a clear error when nothing is left."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    w = weight_bytes(weights, dtype)
    act = activation_bytes(arch, dtype, max_num_batched_tokens, max_num_seqs)
    kv = int(total * utilization) - used - w - act
    if kv <= 0:
        gib = 2 ** 30
        raise ValueError(f"gpu_memory_utilization={utilization} of {total / gib:.1f} GiB leaves no room for the KV "
                         f"cache: {used / gib:.1f} GiB already in use, weights {w / gib:.1f} GiB, activations "
                         f"~{act / gib:.1f} GiB; raise gpu_memory_utilization (at most 1) or lower "
                         "max_num_batched_tokens / max_num_seqs")
    return kv

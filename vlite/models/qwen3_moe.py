"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's layers with a mixture of experts for the MLP."""

from __future__ import annotations

from vlite.layers.decoder import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3's attention (per-head q/k RMSNorm, explicit `head_dim`) and, on the config's `moe_layers`,
    the shared `SparseMoE` (vlite.layers.moe): softmax router, top `num_experts_per_tok` of `num_experts`,
    renormalized where `norm_topk_prob`. The layers the config keeps dense (`mlp_only_layers`, those off
    the `decoder_sparse_step` pattern) run the plain gated MLP of `intermediate_size`."""

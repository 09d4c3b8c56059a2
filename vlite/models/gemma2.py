"""Gemma 2."""

from __future__ import annotations

from vlite.layers.decoder import CausalLM, SandwichDecoderLayer


class Gemma2ForCausalLM(CausalLM):
    """Norms before and after attention and MLP (`SandwichDecoderLayer`), RMSNorm scaling by (1 + weight),
    a GELU-tanh gated MLP, embeddings times sqrt(hidden_size): features the registry fixes for the family.
    From the config: every other layer (the first included) slides over `sliding_window` keys,
    attention scores and final logits are soft-capped (`attn_logit_softcapping`, 50; `final_logit_softcapping`,
    30), queries scaled by query_pre_attn_scalar ** -0.5; the head is tied.

    Soft-capped attention runs on torch's einsum path (the C++ decode kernel has no soft-capping).
    """

    layer_class = SandwichDecoderLayer

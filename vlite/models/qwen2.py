"""Qwen2 and Qwen2.5."""

from __future__ import annotations

from vlite.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's decoder (`LlamaDecoderLayer`, the shared attention) with a bias on the q, k and v projections
    and none on o_proj (the registry's features for "qwen2": its config.json does not say so); embeddings
    often tied.

    Llama's class, because the C++ decode layer takes a QKV bias: quantized Qwen2 models keep the
    one-call-per-layer decode path.
    """

"""Qwen3 (dense)."""

from __future__ import annotations

from vlite.layers.decoder import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Each head of q and k RMS-normalized with its own weights before rotary (`qk_norm`, fixed by the
    registry) and an explicit `head_dim` (num_heads * head_dim need not equal hidden_size): options of
    the shared attention block. No biases unless the config's attention_bias says so.

    The C++ decode layer has no q/k norm, so quantized Qwen3 models decode layer by layer (each op
    still on the kernels).
    """

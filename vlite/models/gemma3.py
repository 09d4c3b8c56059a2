"""Gemma 3 (text: Gemma3ForCausalLM, the 270M and 1B checkpoints, and the text model of GGUF files)."""

from __future__ import annotations

from vlite.layers.decoder import CausalLM, SandwichDecoderLayer


class Gemma3ForCausalLM(CausalLM):
    """Gemma 2's layer with a per-head q/k RMSNorm (registry feature) and no attention soft-capping;
    five sliding-window layers to one global (`layer_types`, or `sliding_window_pattern`), the sliding
    ones rotating with their own base (`rope_local_base_freq`, 10000) and the global ones with
    `rope_theta` (and its scaling); head_dim 256 on the real checkpoints.

    Global layers read every KV block, so the cache keeps them all (one block table for both kinds).
    """

    layer_class = SandwichDecoderLayer

"""SmolLM3: Llama's pre-norm decoder in which some layers apply no rotary (NoPE)."""

from __future__ import annotations

from vlite.layers.decoder import CausalLM


class SmolLM3ForCausalLM(CausalLM):
    """The layers of `ModelArchConfig.nope_layers` (every fourth by default; config.json's
    `no_rope_layers`) skip the rotation in the shared attention. The plain `CausalLM`, not Llama's
    class: Llama's one-C++-call decode layer always rotates.
    """

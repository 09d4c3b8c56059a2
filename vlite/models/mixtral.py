"""Mixtral: Mistral's layers (a sliding window on every layer where the config sets one) with a mixture
of experts for every MLP."""

from __future__ import annotations

from vlite.layers.decoder import CausalLM


class MixtralForCausalLM(CausalLM):
    """The plain pre-norm decoder and the shared `SparseMoE`, read under Mixtral's checkpoint names
    (`block_sparse_moe.gate`, experts' `w1`/`w3`/`w2` = gate/up/down; the registry sets them). Its router
    always renormalizes the top-k weights (softmax, top-k, divided by their sum: the same as a softmax
    over the top-k logits)."""

"""OLMoE: pre-norm layers with OLMo 2's q/k RMSNorm over the whole q and k projections and a mixture of
experts for every MLP."""

from __future__ import annotations

from vlite.layers.decoder import CausalLM


class OlmoeForCausalLM(CausalLM):
    """The plain pre-norm `DecoderLayer` (unlike OLMo 2, norms before attention and MLP), q/k norms over
    all heads at once (`qk_norm_full`), and the shared `SparseMoE` (softmax router, top-k, renormalized
    where `norm_topk_prob`) on every layer. Configs with `clip_qkv` are refused when read."""

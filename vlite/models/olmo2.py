"""OLMo 2: the shared decoder with norms after attention and after the MLP instead of before them
(`PostNormDecoderLayer`), and q/k RMSNorm over the whole q and k projections, all heads at once, before
rotary (`qk_norm_full`, fixed by the registry). No biases.
"""

from __future__ import annotations

from vlite.layers.decoder import CausalLM, PostNormDecoderLayer


class Olmo2ForCausalLM(CausalLM):
    layer_class = PostNormDecoderLayer

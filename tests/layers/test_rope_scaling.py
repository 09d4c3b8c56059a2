"""Rope scaling parameters (vlite.layers.rope_scaling): llama3's factors recovered from llama.cpp's divisors."""

from __future__ import annotations

import numpy as np
import pytest

from vlite.layers.rope_scaling import llama3_factors, llama3_rope_from_factors


def test_llama3_rope_recovered_from_gguf_factors() -> None:
    params = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors = llama3_factors(500000.0, 64, params)
    fitted = llama3_rope_from_factors(factors, 500000.0, 64, 8192)
    assert fitted is not None
    assert fitted["factor"] == 32.0
    assert fitted["low_freq_factor"] == pytest.approx(1.0, rel=1e-6)
    assert fitted["high_freq_factor"] == pytest.approx(4.0, rel=1e-6)
    assert llama3_rope_from_factors(np.ones(32), 500000.0, 64, 8192) is None


@pytest.mark.parametrize("params", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 8.0, "original_max_position_embeddings": 256},  # betas and truncate left to the defaults
    {"factor": 4.0, "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"factor": 2.0, "original_max_position_embeddings": 1024, "attention_factor": 1.3}])
def test_yarn_matches_transformers(params: dict) -> None:
    """YaRN's frequencies and attention factor as transformers computes them (_compute_yarn_parameters), from the
    config parser's dict (defaults filled by yarn_scaling) to RotaryEmbedding's tables."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from vlite.layers.rotary_embedding import RotaryEmbedding
    from vlite.model_loader.hf_config import arch_from_hf_config

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 128, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 8192,
              "rope_parameters": rope}
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig(**config))
    arch = arch_from_hf_config(config)
    assert arch.rope_scaling["attention_factor"] == pytest.approx(attention, rel=1e-12)
    rotary = RotaryEmbedding(arch.rotary_dim, 300, arch.rope_theta, arch.rope_scaling)
    freqs = torch.arange(300).float()[:, None] * inv_freq[None, :]
    assert torch.equal(rotary.cos_cached, torch.cat([freqs, freqs], -1).cos() * attention)

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

"""Rope scaling parameters in Hugging Face terms, as `RotaryEmbedding` (rotary_embedding.py) reads them.

The config parsers (vlite/model_loader/hf_config.py, gguf_config.py) bring every source to these
dicts: LongRoPE's context and attention factor, llama3's factors from llama.cpp's stored divisors.
numpy only, no torch: the API process parses configs too.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["ROPE_TYPES", "llama3_factors", "llama3_rope_from_factors", "longrope_scaling", "yarn_scaling"]

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")  # what RotaryEmbedding computes


def yarn_scaling(scaling: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """YaRN (gpt-oss: factor 32 over 4,096 positions): the scaling with what transformers derives where the
    config leaves it out (_compute_yarn_parameters): `factor` from max_position_embeddings over the original
    context, `attention_factor` (cos and sin scaled by it) 0.1 ln(factor) + 1, or the ratio of the mscale
    terms where mscale and mscale_all_dim are given; beta_fast 32, beta_slow 1; `truncate` True (the
    correction range rounded outwards to whole dims; gpt-oss's config says False)."""
    orig = scaling.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    factor = float(scaling.get("factor") or max_positions / int(orig))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {**scaling, "factor": factor, "original_max_position_embeddings": int(orig),
            "attention_factor": float(attention), "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1), "truncate": bool(scaling.get("truncate", True))}


def longrope_scaling(config: dict[str, Any], scaling: dict[str, Any], max_positions: int
                     ) -> tuple[dict[str, Any], int]:
    """LongRoPE (Phi-3 128k, Phi-4-mini): the scaling, with the checkpoint's full context as
    `long_max_position_embeddings`, and the default context: original_max_position_embeddings.

    Which factors rotate is fixed per engine, by its max_model_len (`ModelArchConfig.with_max_model_len`):
    within the original context (the default) the short factors; asked for more (max_model_len up
    to max_position_embeddings), the long factors for every token of every request, short prompts too.
    That is vLLM's rule (Phi3LongRoPEScaledRotaryEmbedding: use_long_rope = max_model_len >
    original_max_position_embeddings, "to prevent KV cache invalidation when sequences cross this
    threshold"), though vLLM's default max_model_len is the full context. transformers instead switches
    per forward call (dynamic_rope_update: the long factors when the call's largest position reaches the
    original context): a prompt longer than it, prefilled in one call, and all it generates use the long
    factors, the same as here; but a sequence that grows past the original context keeps the keys it
    cached with the short factors and rotates the new ones with the long, and a shorter prompt gets the
    short factors. A per-call switch would make a request's rotation depend on the batch it shares a
    step with and the cached keys disagree with the new ones, so vlite chooses once, by max_model_len.

    The attention factor (cos and sin scaled by it) comes from the full context, as transformers derives
    it, for both factor sets."""
    orig = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    orig = int(orig)
    factor = float(scaling.get("factor") or max_positions / orig)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    scaling = {**scaling, "original_max_position_embeddings": orig, "attention_factor": float(attention),
               "long_max_position_embeddings": max(max_positions, orig)}
    return scaling, min(max_positions, orig)


def llama3_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors that llama3 rope scaling applies (llama.cpp's ``rope_freqs``)."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    orig = float(scaling["original_max_position_embeddings"])
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < orig / high, 1.0, out)
    out = np.where(wavelen > orig / low, factor, out)
    return out


def llama3_rope_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, original_context: int
) -> dict[str, Any] | None:
    """Recover an HF ``llama3`` rope_scaling dict from llama.cpp's stored divisors.

    Only the ratios low/high to the original context are identifiable, so the
    original context is fixed and the two factors are fitted to the transition
    band; the result is checked to reproduce the stored divisors.
    """
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(inv_freq) != len(factors):
        raise ValueError(f"rope_freqs has {len(factors)} entries, expected {len(inv_freq)}")
    x = original_context * inv_freq / (2 * math.pi)  # = orig / wavelen, decreasing
    is_one = np.abs(factors - 1.0) < 1e-4
    is_max = np.abs(factors - factor) < 1e-4 * factor
    mid = ~(is_one | is_max)
    if mid.sum() >= 2:
        # smooth = (x - low) / (high - low) is linear in x: fit it.
        smooth = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(x[mid], smooth, 1)
        low = -intercept / slope
        high = low + 1.0 / slope
    else:
        # No usable transition band: put the thresholds between the neighbours.
        hi_x = x[is_one].min() if is_one.any() else x.max() * 2
        lo_x = x[is_max].max() if is_max.any() else x.min() / 2
        high = float(np.sqrt(hi_x * max(x[~is_one].max() if (~is_one).any() else hi_x / 2, 1e-30)))
        low = float(np.sqrt(lo_x * max(x[~is_max].min() if (~is_max).any() else lo_x * 2, 1e-30)))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(original_context),
    }
    if not np.allclose(llama3_factors(theta, head_dim, scaling), factors, rtol=1e-3, atol=1e-3):
        raise ValueError("could not express the GGUF rope_freqs tensor as llama3 rope scaling")
    return scaling

"""Rotary position embedding with a precomputed cos/sin table indexed by position; the scaling dicts it
reads are described, and built from what checkpoints store, in rope_scaling.py."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from vlite.layers.rope_scaling import ROPE_TYPES


def _inv_freq(head_dim: int, base: float, rope_scaling: Optional[dict]) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "longrope":  # one factor set for every position, chosen by max_model_len (longrope_scaling)
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        factors = rope_scaling["long_factor" if rope_scaling.get("use_long_factor") else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** shape)
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "proportional":  # Gemma 4's global layers: the first share of each half rotates, the rest not
        rotated = int(float(rope_scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv_freq[rotated:] = 0.0  # angle 0: cos 1, sin 0
        return inv_freq / float(rope_scaling.get("factor", 1.0))
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, rope_scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's frequencies (rope_scaling.yarn_scaling's dict), in float32 as transformers computes them: the
    fast dims (more than beta_fast turns over the original context) keep their frequency, the slow ones (under
    beta_slow turns) are divided by `factor`, a linear ramp between."""
    factor, orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def correction_dim(turns: float) -> float:  # the dim whose wavelength turns `turns` times in `orig` positions
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(float(scaling["beta_fast"])), correction_dim(float(scaling["beta_slow"]))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: Optional[dict]) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        # longrope and yarn scale cos and sin (the attention factor), as transformers does, in float32
        scale = float((rope_scaling or {}).get("attention_factor", 1.0))
        self.register_buffer("cos_cached", emb.cos() * scale, persistent=False)
        # rotate-half's sign folded into the sine once (first half negated): one index per step
        half = head_dim // 2
        sin = emb.sin() * scale
        self.register_buffer("signed_sin_cached", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1),
                             persistent=False)

    def get_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables for one step, [T, 1, D], computed once and shared by every layer.

        The sine comes with rotate-half's sign folded in (first half negated), so that
        rotate_half(x) * sin == x.roll(D / 2) * signed_sin, one op fewer per use.
        """
        cos, signed_sin = self.get_cos_sin_f32(positions)
        return cos.to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]

    def get_cos_sin_f32(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same tables as [T, D] float32 rows, for the C++ in-place rotation."""
        return self.cos_cached.index_select(0, positions), self.signed_sin_cached.index_select(0, positions)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by position: x * cos + rotate_half(x) * sin."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

"""Rotary position embedding with a precomputed cos/sin table indexed by position."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float, rope_scaling: Optional[dict]) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
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
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: Optional[dict]) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D]; k [T, H_kv, D]."""
        cos = self.cos_cached[positions].to(q.dtype)[:, None, :]
        sin = self.sin_cached[positions].to(q.dtype)[:, None, :]
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

"""Where an adapter's matrices land in vlite's fused projections, and an adapter's slot form for the ops.

vlite runs q/k/v as one `qkv` matmul and gate/up as one `gate_up` (vlite.layers.linear.fuse_rows: rows
concatenated in that order), so a PEFT adapter's per-module pairs are placed at their output rows:

    qkv      rows [0, q) q_proj | [q, q + kv) k_proj | [q + kv, q + 2 kv) v_proj     (in: hidden)
    o        rows [0, hidden) o_proj                                                  (in: q)
    gate_up  rows [0, I) gate_proj | [I, 2 I) up_proj                                 (in: hidden)
    down     rows [0, hidden) down_proj                                               (in: I)

(q = heads * head_dim, kv = kv_heads * head_dim, I = intermediate_size; a fused checkpoint, Phi-3, has one
qkv_proj and one gate_up_proj module instead.) In a slot, a projection's modules share one A and one B: module
j owns rank columns [j * max_rank, (j + 1) * max_rank), so A = [A_q; A_k; A_v] and B is block-diagonal,
zero elsewhere; `output_slices` tells the expand step which blocks are non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from vlite.model_arch import ModelArchConfig

PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class ModuleSpec:
    """A checkpoint module (`q_proj`, ...) as a part of one of vlite's fused projections."""

    name: str  # the checkpoint's module name: "q_proj"
    parent: str  # its block in the checkpoint: "self_attn" or "mlp"
    projection: str  # vlite's fused projection: "qkv", "o", "gate_up" or "down"
    index: int  # its place among the projection's modules (fuse_rows' order)
    out_offset: int  # first output row in the fused projection
    out_features: int
    in_features: int


class LoRASlice(NamedTuple):
    """One module's block of a slot's B: output rows [out_start, out_end), rank columns [rank_start, rank_end)."""

    out_start: int
    out_end: int
    rank_start: int
    rank_end: int


def module_specs(cfg: ModelArchConfig) -> dict[str, ModuleSpec]:
    """The checkpoint modules vlite can apply LoRA to on a model of `cfg`, by name."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    if cfg.fused_checkpoint:
        parts = [("qkv_proj", "self_attn", "qkv", 0, 0, q + 2 * kv, h),
                 ("gate_up_proj", "mlp", "gate_up", 0, 0, 2 * inter, h)]
    else:
        parts = [("q_proj", "self_attn", "qkv", 0, 0, q, h), ("k_proj", "self_attn", "qkv", 1, q, kv, h),
                 ("v_proj", "self_attn", "qkv", 2, q + kv, kv, h),
                 ("gate_proj", "mlp", "gate_up", 0, 0, inter, h), ("up_proj", "mlp", "gate_up", 1, inter, inter, h)]
    parts += [("o_proj", "self_attn", "o", 0, 0, h, q), ("down_proj", "mlp", "down", 0, 0, h, inter)]
    return {p[0]: ModuleSpec(*p) for p in parts}


def projection_modules(cfg: ModelArchConfig, projection: str) -> list[ModuleSpec]:
    """The modules of one fused projection, in row order."""
    return sorted((m for m in module_specs(cfg).values() if m.projection == projection), key=lambda m: m.index)


def projection_shape(cfg: ModelArchConfig, projection: str) -> tuple[int, int]:
    """(out_features, in_features) of a fused projection."""
    mods = projection_modules(cfg, projection)
    return sum(m.out_features for m in mods), mods[0].in_features


def output_slices(cfg: ModelArchConfig, projection: str, max_rank: int) -> tuple[LoRASlice, ...]:
    """The non-zero blocks of every slot's B for `projection` (the same for all slots: pass to the ops)."""
    return tuple(LoRASlice(m.out_offset, m.out_offset + m.out_features, m.index * max_rank, (m.index + 1) * max_rank)
                 for m in projection_modules(cfg, projection))


def slot_rank(cfg: ModelArchConfig, projection: str, max_rank: int) -> int:
    """The padded rank R of a projection's slot: max_rank per module it fuses."""
    return len(projection_modules(cfg, projection)) * max_rank


def empty_slots(cfg: ModelArchConfig, projection: str, num_slots: int, max_rank: int,
                dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed stacked weights of one projection: A [S, R, K] and B [S, N, R] (R = slot_rank)."""
    n, k = projection_shape(cfg, projection)
    r = slot_rank(cfg, projection, max_rank)
    return (torch.zeros(num_slots, r, k, dtype=dtype, device=device),
            torch.zeros(num_slots, n, r, dtype=dtype, device=device))

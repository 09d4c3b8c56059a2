"""Which part of each weight a tensor-parallel rank holds, cut as the checkpoint is read.

    q/k/v, gate/up   column-parallel: each rank the output rows of its heads / intermediate slice
    o, down          row-parallel: the matching input columns; the ranks' partial sums are all-reduced
    embed, lm_head   vocab-parallel: each rank a contiguous range of token rows; logits are gathered

Heads go to ranks by KV group, so each rank's query heads share its own KV heads with the model's
group size (9 query heads over 3 KV heads on 2 ranks: 6+2 and 3+1). With fewer KV heads than ranks,
each KV head is replicated on world/num_kv ranks, which split its group's query heads. Packed
(quantized) weights split rows freely and columns at multiples of the 32-input block only, so every
stored value and scale is kept as is; a split that would cut a block is an error naming the layer.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from vlite.layers.packed import QK, PackedTensors

if TYPE_CHECKING:
    import torch

    from vlite.model_arch import ModelArchConfig

# Families whose layers are the plain Attention + GatedMLP of vlite.layers (no mixture of experts,
# no norm over all heads, no sandwich norms).
TP_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")

Weight = Union["torch.Tensor", PackedTensors]


@dataclass(frozen=True)
class TPShard:
    rank: int
    world_size: int
    q_heads: tuple[int, int]  # [start, end) of the model's query heads
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_sizes: tuple[int, ...]  # every rank's vocab rows, in rank order (for the logits gather)


def _even(n: int, parts: int, i: int, unit: int = 1) -> tuple[int, int]:
    """Part i of n split into `parts` near-equal contiguous ranges, cut at multiples of `unit`."""
    units = n // unit
    return (i * units // parts * unit, n if i == parts - 1 else (i + 1) * units // parts * unit)


def plan_tp(arch: ModelArchConfig, world_size: int) -> list[TPShard]:
    """Every rank's shard; a model tensor parallelism cannot split is a ValueError naming why."""
    if world_size == 1:
        full = (0, arch.num_attention_heads), (0, arch.num_key_value_heads)
        return [TPShard(0, 1, *full, (0, arch.intermediate_size), (0, arch.vocab_size), (arch.vocab_size,))]
    if arch.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size={world_size}: {arch.architecture} models are not supported under "
                         f"tensor parallelism (supported: {', '.join(TP_ARCHITECTURES)})")
    if arch.num_experts or arch.qk_norm_full:
        raise ValueError(f"tensor_parallel_size={world_size}: mixtures of experts and norms over all heads are not "
                         f"supported under tensor parallelism")
    h, hkv = arch.num_attention_heads, arch.num_key_value_heads
    group = h // hkv
    if world_size > h:
        raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's {h} attention heads")
    if arch.intermediate_size < world_size * QK:
        raise ValueError(f"tensor_parallel_size={world_size} is too large for intermediate_size="
                         f"{arch.intermediate_size} (at least {QK} columns per rank)")
    if hkv < world_size and (world_size % hkv or group < world_size // hkv):
        raise ValueError(f"tensor_parallel_size={world_size}: {hkv} KV heads of {group} query heads each cannot be "
                         f"replicated evenly (world size must be a multiple of the KV heads, at most "
                         f"{hkv * group})")
    vocab = [_even(arch.vocab_size, world_size, r) for r in range(world_size)]
    unit = QK if arch.intermediate_size % QK == 0 else 1
    out = []
    for r in range(world_size):
        if hkv >= world_size:
            kv = _even(hkv, world_size, r)
            q = (kv[0] * group, kv[1] * group)
        else:
            per_kv = world_size // hkv
            k = r // per_kv
            j0, j1 = _even(group, per_kv, r % per_kv)
            kv, q = (k, k + 1), (k * group + j0, k * group + j1)
        out.append(TPShard(r, world_size, q, kv, _even(arch.intermediate_size, world_size, r, unit), vocab[r],
                           tuple(b - a for a, b in vocab)))
    return out


def shard_arch(arch: ModelArchConfig, shard: TPShard) -> ModelArchConfig:
    """The config of this rank's part of the model: its heads and intermediate slice (vocab_size stays
    the model's: logits are gathered to the full vocabulary)."""
    return dataclasses.replace(arch, num_attention_heads=shard.q_heads[1] - shard.q_heads[0],
                               num_key_value_heads=shard.kv_heads[1] - shard.kv_heads[0],
                               intermediate_size=shard.intermediate[1] - shard.intermediate[0])


_ROWS = re.compile(r"\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_COLS = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")


def shard_weight(name: str, w: Weight, arch: ModelArchConfig, shard: TPShard) -> Weight:
    """This rank's part of the checkpoint tensor `name` (a copy: the full tensor can be freed)."""
    hd = arch.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _rows(w, *shard.vocab)
    m = _ROWS.search(name)
    if m:
        if m.group(2) is None:  # gate / up
            return _rows(w, *shard.intermediate)
        a, b = shard.q_heads if m.group(2) == "q" else shard.kv_heads
        return _rows(w, a * hd, b * hd)
    m = _COLS.search(name)
    if m:
        a, b = ((shard.q_heads[0] * hd, shard.q_heads[1] * hd) if "o_proj" in name else shard.intermediate)
        try:
            return w.cols(a, b) if isinstance(w, PackedTensors) else w[:, a:b].contiguous()
        except ValueError as e:
            raise ValueError(f"{name}: cannot shard for tensor parallelism: {e}") from None
    return w  # norms, and the biases the driver rank alone adds (o_proj, down_proj)


def _rows(w: Weight, a: int, b: int) -> Weight:
    if isinstance(w, PackedTensors):
        return PackedTensors(w.fmt, w.qs[a:b].clone(), w.scales[a:b].clone(),
                             None if w.mins is None else w.mins[a:b].clone(), w.sub)
    return w[a:b].clone()

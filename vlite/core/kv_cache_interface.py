"""What each kind of layer keeps per request, in vLLM V1's names (vllm/v1/kv_cache_interface.py).

A model's layers fall into KV cache groups, one per kind: attention layers hold K/V in blocks of
`block_size` tokens (`FullAttentionSpec`; `SlidingWindowSpec` where only the last `sliding_window` keys are
read), linear-attention layers a fixed-size recurrent state per request (`MambaSpec`, as vLLM names every
such state). `KVCacheConfig` sizes them from one memory budget: the state slots first (one per request that
may run, plus the prefix cache's saved states), the rest as KV blocks. No torch: the scheduler reads these.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlite.model_arch import ModelArchConfig


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    @property
    def page_size_bytes(self) -> int:
        """One layer's K and V for one block."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 0


@dataclass(frozen=True)
class MambaSpec:
    """A recurrent layer's state per request: `shapes` of its tensors (Gated DeltaNet: the conv1d's last inputs
    [conv_dim, K - 1] and the delta-rule state [Hv, Dk, Dv]), float32."""

    shapes: tuple[tuple[int, ...], ...]
    dtype_bytes: int = 4

    @property
    def state_bytes(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total * self.dtype_bytes


KVCacheSpec = FullAttentionSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layer_indices: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int  # KV blocks of the attention group, each holding every attention layer's page
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    num_state_slots: int = 0  # recurrent-state slots: running requests' first, then the prefix cache's
    num_cached_state_slots: int = 0  # of those, kept for the prefix cache (states saved at block boundaries)

    @property
    def state_group(self) -> KVCacheGroupSpec | None:
        return next((g for g in self.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)), None)

    @property
    def attention_group(self) -> KVCacheGroupSpec | None:
        return next((g for g in self.kv_cache_groups if isinstance(g.kv_cache_spec, FullAttentionSpec)), None)

    @property
    def block_bytes(self) -> int:
        g = self.attention_group
        return len(g.layer_indices) * g.kv_cache_spec.page_size_bytes if g is not None else 0

    @property
    def state_slot_bytes(self) -> int:
        """One request's state over every recurrent layer."""
        g = self.state_group
        return len(g.layer_indices) * g.kv_cache_spec.state_bytes if g is not None else 0


def kv_cache_groups(arch: ModelArchConfig, block_size: int, dtype_bytes: int) -> tuple[KVCacheGroupSpec, ...]:
    """The model's groups: its attention layers (full, or sliding where every one slides: the manager then frees
    what left the window), and its linear-attention layers where it has them."""
    groups = []
    attention = arch.attention_layers
    if attention:
        window = arch.kv_sliding_window
        spec = (SlidingWindowSpec(block_size, arch.num_key_value_heads, arch.head_dim, dtype_bytes, window)
                if window else FullAttentionSpec(block_size, arch.num_key_value_heads, arch.head_dim, dtype_bytes))
        groups.append(KVCacheGroupSpec(attention, spec))
    if arch.linear_layers:
        conv = (arch.linear_conv_dim, arch.linear_conv_kernel_dim - 1)
        ssm = (arch.linear_num_value_heads, arch.linear_key_head_dim, arch.linear_value_head_dim)
        groups.append(KVCacheGroupSpec(arch.linear_layers, MambaSpec((conv, ssm))))
    return tuple(groups)


def num_cached_state_slots(max_num_seqs: int, enable_caching: bool) -> int:
    """States the prefix cache keeps (each a whole request's state at the last block boundary of a prompt): a
    quarter as many as requests may run, at least 4; none without prefix caching."""
    return max(4, max_num_seqs // 4) if enable_caching else 0

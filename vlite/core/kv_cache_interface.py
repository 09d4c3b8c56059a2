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
    num_blocks: int  # KV blocks of the shared pool, each a page of every KV buffer (`block_bytes`)
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    num_state_slots: int = 0  # recurrent-state slots: running requests' first, then the prefix cache's
    num_cached_state_slots: int = 0  # of those, kept for the prefix cache (states saved at block boundaries)

    @property
    def state_group(self) -> KVCacheGroupSpec | None:
        return next((g for g in self.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)), None)

    @property
    def attention_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return tuple(g for g in self.kv_cache_groups if isinstance(g.kv_cache_spec, FullAttentionSpec))

    @property
    def buffer_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """The KV buffers a block of the pool is a page of, as (kv heads, head size, count) per page shape: layer j of
        every attention group of one shape shares that shape's j-th buffer (a block is held by one group at a
        time), and a shape has as many buffers as its largest group has layers. One shape but for Gemma 4,
        whose full-attention layers have heads of their own size."""
        shapes: dict[tuple[int, int], int] = {}
        for g in self.attention_groups:
            key = (g.kv_cache_spec.num_kv_heads, g.kv_cache_spec.head_size)
            shapes[key] = max(shapes.get(key, 0), len(g.layer_indices))
        return tuple((heads, size, n) for (heads, size), n in shapes.items())

    @property
    def block_bytes(self) -> int:
        """One block of the shared pool: a page of each buffer (`buffer_shapes`)."""
        groups = self.attention_groups
        if not groups:
            return 0
        spec = groups[0].kv_cache_spec
        return sum(n * 2 * spec.block_size * heads * size * spec.dtype_bytes for heads, size, n in self.buffer_shapes)

    @property
    def group_windows(self) -> tuple[int, ...]:
        """Each attention group's window (0: full attention), the KV cache manager's groups."""
        return tuple(getattr(g.kv_cache_spec, "sliding_window", 0) for g in self.attention_groups)

    def blocks_per_request(self, num_tokens: int, chunk_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens holds at most, in every attention group: all of its blocks in
        a full group; in a sliding one those the window reads, plus a step's chunk of at most `chunk_tokens`."""
        total = 0
        for g in self.attention_groups:
            bs, window = g.kv_cache_spec.block_size, getattr(g.kv_cache_spec, "sliding_window", 0)
            span = min(num_tokens, window + chunk_tokens) if window else num_tokens
            total += -(-span // bs) + (1 if window and span < num_tokens else 0)
        return total

    def max_tokens_per_request(self, chunk_tokens: int) -> int:
        """The longest request the pool holds alone (the engine's KV capacity in tokens)."""
        groups = self.attention_groups
        if not groups:
            return 0
        bs = groups[0].kv_cache_spec.block_size
        lo, hi = 0, self.num_blocks * bs  # a request never holds fewer blocks than its tokens fill in one group
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_per_request(mid, chunk_tokens) <= self.num_blocks else (lo, mid - 1)
        return lo

    @property
    def state_slot_bytes(self) -> int:
        """One request's state over every recurrent layer."""
        g = self.state_group
        return len(g.layer_indices) * g.kv_cache_spec.state_bytes if g is not None else 0


def kv_cache_groups(arch: ModelArchConfig, block_size: int, dtype_bytes: int,
                    split_windows: bool = True) -> tuple[KVCacheGroupSpec, ...]:
    """The model's KV cache groups: its attention layers, and its linear-attention layers where it has them.

    Attention layers of one kind (one window, one head shape) make one group. Where kinds mix (Gemma 2/3, gpt-oss:
    sliding and full layers) and `split_windows`, each kind is cut into groups of as many layers as the smallest
    kind has (vLLM's hybrid allocator): every group then has the same number of layers, layer j of each group
    shares the j-th KV buffer of its head shape with layer j of the others, and a block of the shared pool is one
    page of those buffers, held by one group at a time. The last group of a kind may have fewer layers (its
    missing ones are padding). Without `split_windows` (backends that read one block table) the attention layers
    of one head shape stay one group that keeps every block, sliding ones included. Full-attention groups come
    first. Layers that share another's K/V (Gemma 4's last ones) are in no group: they read their source's pages."""
    groups = []
    by_kind: dict[tuple[int, int, int], list[int]] = {}  # (window, kv heads, head size) -> its layers
    for i in arch.kv_layers:  # KV-shared layers (Gemma 4) read their source layer's pages and hold none
        by_kind.setdefault((arch.layer_window(i), arch.layer_kv_heads(i), arch.layer_head_dim(i)), []).append(i)

    def spec(window: int, heads: int, size: int) -> FullAttentionSpec:
        if window:
            return SlidingWindowSpec(block_size, heads, size, dtype_bytes, window)
        return FullAttentionSpec(block_size, heads, size, dtype_bytes)

    if len(by_kind) == 1:
        (kind, layers), = by_kind.items()
        groups.append(KVCacheGroupSpec(tuple(layers), spec(*kind)))
    elif by_kind and not split_windows:  # one full group per head shape, each keeping every block
        by_shape: dict[tuple[int, int], list[int]] = {}
        for (_, heads, size), layers in by_kind.items():
            by_shape.setdefault((heads, size), []).extend(layers)
        groups += [KVCacheGroupSpec(tuple(sorted(layers)), spec(0, *shape)) for shape, layers in by_shape.items()]
    elif by_kind:
        size = min(len(layers) for layers in by_kind.values())
        for kind in sorted(by_kind):
            layers = by_kind[kind]
            groups += [KVCacheGroupSpec(tuple(layers[i:i + size]), spec(*kind)) for i in range(0, len(layers), size)]
    if arch.linear_layers:
        conv = (arch.linear_conv_dim, arch.linear_conv_kernel_dim - 1)
        ssm = (arch.linear_num_value_heads, arch.linear_key_head_dim, arch.linear_value_head_dim)
        groups.append(KVCacheGroupSpec(arch.linear_layers, MambaSpec((conv, ssm))))
    return tuple(groups)


def num_cached_state_slots(max_num_seqs: int, enable_caching: bool) -> int:
    """States the prefix cache keeps (each a whole request's state at the last block boundary of a prompt): a
    quarter as many as requests may run, at least 4; none without prefix caching."""
    return max(4, max_num_seqs // 4) if enable_caching else 0


def kv_cache_report(config: KVCacheConfig) -> list[dict]:
    """Per KV cache group, what a benchmark reports: its kind, layers and window, the KV bytes one token costs
    its layers (attention groups; a sliding group holds about window + one step's chunk of tokens), or the
    state bytes one request holds (the recurrent-state group, whatever its length)."""
    out = []
    for g in config.kv_cache_groups:
        spec = g.kv_cache_spec
        row = {"kind": type(spec).__name__, "layers": len(g.layer_indices)}
        if isinstance(spec, MambaSpec):
            row.update(state_bytes_per_request=len(g.layer_indices) * spec.state_bytes,
                       state_slots=config.num_state_slots, cached_state_slots=config.num_cached_state_slots)
        else:
            row.update(window=getattr(spec, "sliding_window", 0),
                       kv_bytes_per_token=len(g.layer_indices) * spec.page_size_bytes // spec.block_size)
        out.append(row)
    return out

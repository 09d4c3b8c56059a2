"""The runner's adapters: loaded ones kept in memory (LRU, `max_cpu_loras`), the step's in `max_loras` slots.

    add_lora(req)           load and check the PEFT folder (LoRAAdapterError: a bad one, nothing else affected)
    set_active(reqs, n)     before a forward: each scheduled request's adapter in a slot, the rows' slots set
    remove_lora(id)         drop it (and its slot): its memory is freed

vLLM's LoRAModelManager with its LRU cache, for a CPU: a slot holds references to the adapter's matrices, not a
copy (vlite.lora.layers), so an adapter's weights are in memory once, and "loading into a slot" costs nothing
but the layers' bookkeeping. The scheduler keeps the running requests' distinct adapters within max_loras, so
a step's adapters always fit the slots; an adapter it needs that was evicted (or removed) meanwhile is loaded
again from its request's path.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from vlite.config import LoRAConfig
from vlite.lora.layers import LoRALayer, LoRAStep
from vlite.lora.layout import PROJECTIONS, ModuleSpec
from vlite.lora.peft_adapter import LoRAModel, ShardFn, load_peft_adapter
from vlite.lora.request import LoRARequest
from vlite.model_arch import ModelArchConfig

logger = logging.getLogger(__name__)


class LoRAModelManager:
    """Adds LoRA layers to `model`'s decoder layers and manages the adapters they apply."""

    def __init__(self, model: nn.Module, cfg: ModelArchConfig, lora_config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device, ops: Any = None, shard: Optional[ShardFn] = None) -> None:
        """`ops`: vlite's C++ kernels (None: the torch path); `shard`: a tensor-parallel rank's cut of each matrix."""
        self.cfg, self.config, self.dtype, self.shard = cfg, lora_config, dtype, shard
        self.step = LoRAStep(ops, device)
        self.layers: list[dict[str, LoRALayer]] = []
        stack = getattr(model, "_fused_stack", None)  # Llama's all-decode C++ layers apply them too
        for i, layer in enumerate(model.layers):
            lora = {p: LoRALayer(cfg, i, p, lora_config.max_loras, lora_config.max_lora_rank, self.step, ops, dtype)
                    for p in PROJECTIONS if p in ("qkv", "o") or i not in cfg.moe_layers}
            layer.self_attn.qkv_lora, layer.self_attn.o_lora = lora["qkv"], lora["o"]
            if "gate_up" in lora:
                layer.mlp.gate_up_lora, layer.mlp.down_lora = lora["gate_up"], lora["down"]
            if stack is not None:
                stack.set_lora(i, *(lora[p].kernel if p in lora else None for p in PROJECTIONS))
            self.layers.append(lora)
        self.adapters: OrderedDict[int, tuple[LoRARequest, LoRAModel]] = OrderedDict()  # least recently used first
        self.pinned: set[int] = set()
        self.slots: list[Optional[int]] = [None] * lora_config.max_loras  # adapter id per slot
        self._slot_used: list[int] = [0] * lora_config.max_loras  # the step that last used each slot
        self._step_count = 0
        self._active: set[int] = set()  # the adapters of the last step (never evicted while in use)

    # ---- adapters ------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter if not loaded; True if it was loaded now."""
        entry = self.adapters.get(lora_request.lora_int_id)
        if entry is not None and entry[0].lora_path == lora_request.lora_path:
            self.adapters.move_to_end(lora_request.lora_int_id)
            return False
        if entry is not None:  # the same id under another folder: the new one replaces it
            self.remove_lora(lora_request.lora_int_id)
        adapter = load_peft_adapter(lora_request.lora_path, self.cfg, self.config.max_lora_rank, self.dtype,
                                    self.shard)
        self.adapters[lora_request.lora_int_id] = (lora_request, adapter)
        logger.info("LoRA adapter %r (id %d) loaded: rank %d, %d modules, %.1f MB", lora_request.lora_name,
                    lora_request.lora_int_id, adapter.rank, len(adapter.modules), adapter.num_bytes() / 1e6)
        self._evict(keep=lora_request.lora_int_id)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self.pinned.discard(lora_int_id)
        if lora_int_id in self.slots:
            self._clear_slot(self.slots.index(lora_int_id))
        return True

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep the adapter loaded whatever the LRU order (vLLM's pin_lora)."""
        if lora_int_id not in self.adapters:
            raise ValueError(f"LoRA adapter id {lora_int_id} is not loaded")
        self.pinned.add(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self.adapters)

    def _evict(self, keep: int) -> None:
        """Down to max_cpu_loras adapters, least recently used first, sparing `keep` (the one just loaded), pinned
        ones and the last step's (so a step's adapters may briefly exceed the limit)."""
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.config.cpu_loras:
                return
            if lora_id != keep and lora_id not in self.pinned and lora_id not in self._active:
                self.remove_lora(lora_id)

    # ---- the step ------------------------------------------------------------------------

    def set_active(self, lora_requests: Sequence[Optional[LoRARequest]], num_scheduled: np.ndarray) -> None:
        """The scheduled requests' adapters (None: the base model), in step order, and their token counts:
        each adapter put in a slot, and every row's slot set for the layers."""
        self._step_count += 1
        ids = {r.lora_int_id for r in lora_requests if r is not None}
        self._active = ids
        if not ids:
            self.step.clear()
            return
        if len(ids) > len(self.slots):
            raise RuntimeError(f"a step with {len(ids)} LoRA adapters exceeds max_loras ({len(self.slots)})")
        slot_of = {r.lora_int_id: self._slot(r, ids) for r in lora_requests if r is not None}
        req_slots = np.fromiter((slot_of[r.lora_int_id] if r is not None else -1 for r in lora_requests),
                                dtype=np.int32, count=len(lora_requests))
        self.step.update(np.repeat(req_slots, num_scheduled))

    def _slot(self, lora_request: LoRARequest, step_ids: set[int]) -> int:
        """The adapter's slot, filling one (a free one, else the least recently used of another adapter than
        the step's) where it has none; loaded again from its folder if it was evicted."""
        lora_id = lora_request.lora_int_id
        if lora_id not in self.adapters:
            self.add_lora(lora_request)
        self.adapters.move_to_end(lora_id)
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            free = [s for s, held in enumerate(self.slots) if held is None or held not in step_ids]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_used[s]))
            adapter = self.adapters[lora_id][1]
            for layer in self.layers:
                for lora in layer.values():
                    lora.set_slot(slot, adapter)
            self.slots[slot] = lora_id
        self._slot_used[slot] = self._step_count
        return slot

    def _clear_slot(self, slot: int) -> None:
        for layer in self.layers:
            for lora in layer.values():
                lora.clear_slot(slot)
        self.slots[slot] = None


def tp_shard_fn(cfg: ModelArchConfig) -> Optional[ShardFn]:
    """Under tensor parallelism, an adapter's matrices cut like the layers they modify: B's output rows of the
    column-parallel q/k/v and gate/up (the rank's heads and intermediate slice), A's input columns of the
    row-parallel o and down (their partial sums join the layer's in the all-reduce); None without."""
    from vlite.distributed.parallel_state import get_tp_group
    from vlite.model_loader.tp_shard import shard_weight

    tp = get_tp_group()
    if tp is None or tp.shard is None:
        return None
    shard = tp.shard

    def cut(layer: int, spec: ModuleSpec, which: str, t: torch.Tensor) -> torch.Tensor:
        column_parallel = spec.projection in ("qkv", "gate_up")
        if (which == "B") != column_parallel:  # A of q/k/v/gate/up and B of o/down: whole on every rank
            return t
        return shard_weight(f"model.layers.{layer}.{spec.parent}.{spec.name}.weight", t, cfg, shard)

    return cut

"""A decoder layer's projections under LoRA: each adds the low-rank updates of the step's adapters to its output.

    qkv     = linear(x, W_qkv)          then  lora.apply(qkv, x)       (Attention.forward)
    o       = linear(attn, W_o) + h     then  lora.apply(o, attn)      (before the TP all-reduce: partial sums)
    gate_up = linear(x, W_gate_up)      then  lora.apply(gate_up, x)   (GatedMLP.forward)
    down    = linear(act, W_down) + h   then  lora.apply(down, act)

The base weights (dense or packed GGUF blocks) are untouched: the update is added to whatever the layer's
linear computed. Which adapter a row runs under is the step's (`LoRAStep`, vLLM's punica wrapper: the rows'
slots, set once per step by the runner and read by every layer). An adapter enters one of `max_loras`
slots (vlite.lora.manager) and is applied there:

    CPU kernels   `ops.LoRALinear` holds references to the adapter's own matrices (its weights exist once,
                  in memory), groups the step's rows by slot and runs shrink and expand per slot in C++
    torch         stacked, zero-padded slot buffers (vlite.lora.layout.empty_slots, filled by copying) and
                  vlite.lora.ops.add_lora_linear: a few batched calls per slot (a GPU, or no compiler)
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from vlite.lora.layout import empty_slots, output_slices, projection_shape
from vlite.lora.ops import LoRAKernelMeta, add_lora_linear
from vlite.lora.peft_adapter import LoRAModel
from vlite.model_arch import ModelArchConfig

_NO_ROWS = LoRAKernelMeta(0, (), ())


class LoRAStep:
    """The step's adapter slot per row (-1: the base model), shared by every LoRA layer of the model."""

    def __init__(self, ops: Any, device: torch.device) -> None:
        self.mapping = ops.LoRAMapping() if ops is not None else None  # the C++ layers' grouping
        self.meta = _NO_ROWS  # the torch layers'
        self.device = device
        self.has_lora = False

    def update(self, token_slot: np.ndarray) -> None:
        """The rows' slots [T] for the coming forward."""
        slots = torch.from_numpy(np.ascontiguousarray(token_slot, dtype=np.int32))
        self.has_lora = bool((token_slot >= 0).any())
        if self.mapping is not None:
            self.mapping.set(slots)
        else:
            self.meta = LoRAKernelMeta.make(slots.to(self.device)) if self.has_lora else _NO_ROWS

    def clear(self) -> None:
        """A step without adapter rows: every layer's apply is a no-op."""
        self.has_lora = False
        if self.mapping is not None:
            self.mapping.clear()
        self.meta = _NO_ROWS


class LoRALayer:
    """One fused projection ("qkv", "o", "gate_up", "down") of one decoder layer, with `num_slots` adapter slots."""

    def __init__(self, cfg: ModelArchConfig, layer: int, projection: str, num_slots: int, max_rank: int,
                 step: LoRAStep, ops: Any, dtype: torch.dtype) -> None:
        self.layer, self.projection, self.max_rank, self.step = layer, projection, max_rank, step
        n, k = projection_shape(cfg, projection)
        # the C++ kernels' slots reference the adapters' matrices; the torch path copies into stacked buffers
        self.kernel = ops.LoRALinear(step.mapping, num_slots, n, k) if ops is not None else None
        self.lora_a: Optional[torch.Tensor] = None
        self.lora_b: Optional[torch.Tensor] = None
        if self.kernel is None:
            self.lora_a, self.lora_b = empty_slots(cfg, projection, num_slots, max_rank, dtype, step.device)
            self.slices = output_slices(cfg, projection, max_rank)

    def set_slot(self, slot: int, adapter: LoRAModel) -> None:
        """Put `adapter`'s update of this projection in `slot` (zeros where it leaves the projection alone)."""
        if self.kernel is not None:
            self.kernel.set_slot(slot, [(w.lora_a, w.lora_b.t(), w.out_offset)
                                        for w in adapter.layers[self.layer].get(self.projection, ())])
        else:
            assert self.lora_a is not None and self.lora_b is not None
            adapter.fill_slot(self.layer, self.projection, self.lora_a[slot], self.lora_b[slot], self.max_rank)

    def clear_slot(self, slot: int) -> None:
        if self.kernel is not None:
            self.kernel.clear_slot(slot)
        else:
            assert self.lora_a is not None and self.lora_b is not None
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [T, N] += each row's adapter update of x [T, K], in place (rows of the base model untouched)."""
        if not self.step.has_lora:
            return
        if self.kernel is not None:
            self.kernel.apply(out, x)
        else:
            add_lora_linear(out, x, self.step.meta, self.lora_a, self.lora_b, self.slices)

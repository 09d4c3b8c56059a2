"""The batched LoRA update of one linear layer in a step of many requests under different adapters.

Every row t of the step (a token) runs under the adapter in slot `token_lora_mapping[t]` (-1: none), and the
layer's output gains that adapter's low-rank product:

    out[t] += (x[t] @ A[slot].T) @ B[slot].T          A [S, R, K], B [S, N, R] (scaling in B, zero-padded)
              \\_____ shrink ______/ \\_ expand _/

Rows are grouped by slot once per step (LoRAKernelMeta, shared by every layer), then each layer runs one
shrink and one expand per slot present (vLLM's punica ops' names), not a loop over requests; rows without
an adapter do no work. A fused projection (qkv, gate_up) passes `output_slices` (vlite.lora.layout): each
module's block of B is multiplied alone, so the zeros between the blocks cost nothing.

    token_lora_mapping    [ 2, -1,  0,  2,  2, -1]
    sorted by slot        rows 1 5 | 2 | 0 3 4         (stable: each slot's rows keep their order)
    active_lora_ids       (0, 2)
    token_indices         (slice(2, 3), tensor([0, 3, 4]))   a slice where the rows are contiguous
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from vlite.lora.layout import LoRASlice

Rows = Union[slice, torch.Tensor]  # a slot's rows of the step: a range, or their indices


@dataclass(frozen=True)
class LoRAKernelMeta:
    """A step's rows grouped by adapter slot: built once per step, read by every LoRA layer."""

    num_tokens: int  # T: rows of the step
    active_lora_ids: tuple[int, ...]  # the slots some row uses, ascending (never -1)
    token_indices: tuple[Rows, ...]  # per active slot, its rows (a slice where contiguous)

    @classmethod
    def make(cls, token_lora_mapping: torch.Tensor) -> LoRAKernelMeta:
        """From the step's slot per row [T] (-1: no adapter); one host sync, here and not in the layers."""
        mapping = token_lora_mapping.reshape(-1).long()
        if mapping.numel() == 0:
            return cls(0, (), ())
        order = torch.argsort(mapping, stable=True)
        slots, counts = torch.unique_consecutive(mapping[order], return_counts=True)
        ends = torch.cumsum(counts, 0)
        starts = ends - counts
        firsts, lasts = order[starts], order[ends - 1]  # the stable sort keeps each slot's rows ascending
        active, indices = [], []
        for slot, start, end, first, last in zip(*(t.tolist() for t in (slots, starts, ends, firsts, lasts))):
            if slot < 0:
                continue
            active.append(slot)
            indices.append(slice(first, last + 1) if last - first == end - start - 1 else order[start:end])
        return cls(mapping.numel(), tuple(active), tuple(indices))

    @property
    def has_lora(self) -> bool:
        return bool(self.active_lora_ids)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ A.T -> [n, R]: the rows projected to the adapter's rank."""
    return F.linear(x, lora_a)


def lora_expand(out: torch.Tensor, rows: Rows, h: torch.Tensor, lora_b: torch.Tensor,
                output_slices: Optional[Sequence[LoRASlice]] = None) -> None:
    """out[rows] += h @ B.T, in place; with `output_slices`, block by block (B's other entries are zeros)."""
    blocks = output_slices or (LoRASlice(0, out.shape[1], 0, h.shape[1]),)
    for o0, o1, r0, r1 in blocks:
        delta = F.linear(h[:, r0:r1], lora_b[o0:o1, r0:r1])
        if isinstance(rows, slice):
            out[rows, o0:o1] += delta
        else:
            out[:, o0:o1].index_add_(0, rows, delta)


def add_lora_linear(out: torch.Tensor, x: torch.Tensor, meta: LoRAKernelMeta, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, output_slices: Optional[Sequence[LoRASlice]] = None) -> torch.Tensor:
    """out [T, N] += (x @ A[slot].T) @ B[slot].T for each row with a slot, in place; returns out.

    x [T, K]: the layer's input; lora_a [S, R, K], lora_b [S, N, R]: every slot's weights (scaling in B);
    output_slices: the non-zero blocks of B (vlite.lora.layout.output_slices), None: all of it."""
    assert x.dim() == 2 and out.dim() == 2 and x.shape[0] == out.shape[0] == meta.num_tokens, (x.shape, out.shape)
    for slot, rows in zip(meta.active_lora_ids, meta.token_indices):
        h = lora_shrink(x[rows], lora_a[slot])
        lora_expand(out, rows, h, lora_b[slot], output_slices)
    return out

"""The step's metadata for linear-attention (Gated DeltaNet) layers, and their ops on it.

The runner builds one `GDNAttentionMetadata` per step (vLLM: GDNAttentionMetadata): each scheduled request's rows
in the step's flat token dimension and its state slot. Every linear-attention layer reads the same one, each with
its own state tensors. The ops run on vlite's C++ kernels where they are loaded (`load_kernels`), else in torch
(vlite.attention.ops.gated_delta, the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlite.attention.ops import gated_delta

# vlite's C++ kernels (vlite._custom_ops) where they are built with the Gated DeltaNet ops, else None (torch);
# set by load_kernels() when a model with linear-attention layers starts.
_kernels = None


def load_kernels() -> None:
    global _kernels
    from vlite import _custom_ops

    module = _custom_ops.load()
    _kernels = module if module is not None and hasattr(module, "gated_delta_rule") else None


def _kernel_shapes_ok(k: torch.Tensor, v: torch.Tensor) -> bool:
    return k.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0

@dataclass
class GDNAttentionMetadata:
    state_idx: torch.Tensor  # [R] int64: each request's state slot, in the step's request order
    query_start_loc: list[int]  # [R + 1] where each request's rows start
    query_start_loc_t: torch.Tensor  # the same as an int64 tensor (the kernels')

    @classmethod
    def build(cls, state_idx: np.ndarray, query_start_loc: np.ndarray) -> GDNAttentionMetadata:
        return cls(torch.from_numpy(np.ascontiguousarray(state_idx, dtype=np.int64)), query_start_loc.tolist(),
                   torch.from_numpy(np.ascontiguousarray(query_start_loc, dtype=np.int64)))


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  md: GDNAttentionMetadata) -> torch.Tensor:
    """silu(depthwise causal conv) of x [T, C] over each request's rows after its slot's last inputs."""
    if _kernels is not None and x.dtype in (torch.float32, torch.bfloat16):
        return _kernels.gdn_conv1d(x, weight, conv_state, md.state_idx, md.query_start_loc_t)
    return gated_delta.causal_conv1d(x, weight, conv_state, md.state_idx, md.query_start_loc)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, md: GDNAttentionMetadata, scale: float) -> torch.Tensor:
    """[T, Hv, Dv] float32 outputs of the gated delta rule, each request's slot of `state` updated in place."""
    if _kernels is not None and _kernel_shapes_ok(k, v) and q.dtype == k.dtype == v.dtype:
        return _kernels.gated_delta_rule(q, k, v, g.contiguous(), beta.contiguous(), state, md.state_idx,
                                         md.query_start_loc_t, scale)
    return gated_delta.gated_delta_rule(q, k, v, g, beta, state, md.state_idx, md.query_start_loc, scale)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, D] float32 RMS-normalized, times weight, times silu(gate) (Qwen3.5's gated norm, norm first)."""
    if _kernels is not None and x.dtype == torch.float32 and x.is_contiguous() and gate.is_contiguous():
        return _kernels.gdn_gated_rms_norm(x, gate, weight, eps)
    return gated_delta.gated_rms_norm(x, gate, weight, eps)

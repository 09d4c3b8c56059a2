"""Which attention backend runs on which device, and the one call the model's layers make.

    get_attn_backend(cpu)   -> TorchSDPABackend       (vlite.attention.backends.torch_sdpa)
    get_attn_backend(cuda)  -> TritonAttentionBackend (vlite.attention.backends.triton_attn: imports triton)

The GPU backend is imported lazily, so CPU users never import Triton. A backend has
get_kv_cache_shape, load_kernels, prefill_decode_rows_below, supports_cascade, use_cascade_attention (cascade
attention's cost model) and build_metadata (same inputs on both;
the CPU one reads max_query_len only for its all-decode fast path, the Triton one ignores
max_decode_query_len, as its kernel takes speculative verify chunks as the causal chunks they are, and
decode_rows_below); the layers call paged_attention here with whichever metadata the runner built.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import torch

from vlite.attention.backends import torch_sdpa


class TorchSDPABackend:
    """The CPU backend's module functions behind the backend interface."""

    name = "TORCH_SDPA"
    prefill_decode_rows_below = staticmethod(torch_sdpa.prefill_decode_rows_below)
    get_kv_cache_shape = staticmethod(torch_sdpa.get_kv_cache_shape)
    load_kernels = staticmethod(torch_sdpa.load_kernels)
    supports_cascade = staticmethod(torch_sdpa.supports_cascade)
    use_cascade_attention = staticmethod(torch_sdpa.use_cascade_attention)

    @staticmethod
    def build_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       slot_mapping: torch.Tensor, block_size: int, windows: Sequence[int] = (0,),
                       max_query_len: Optional[int] = None,
                       max_decode_query_len: Union[int, torch.Tensor] = 1,
                       decode_rows_below: int = 0, precise_rows: Optional[int] = None,
                       common_prefix_len: int = 0) -> torch_sdpa.TorchSDPAMetadata:
        return torch_sdpa.build_metadata(query_start_loc, seq_lens, block_table, slot_mapping, block_size, windows,
                                         max_decode_query_len, decode_rows_below, max_query_len, precise_rows,
                                         common_prefix_len)


BACKENDS = ("TORCH_SDPA", "TRITON_ATTN")


def get_attn_backend(device: torch.device) -> Any:
    """The backend class for `device` ("cpu" or "cuda").

    VLITE_ATTENTION_BACKEND (as vLLM's VLLM_ATTENTION_BACKEND) overrides the choice: TRITON_ATTN on a
    CPU runs the Triton kernels under TRITON_INTERPRET=1 (tests: the whole engine on the GPU's kernels).
    """
    forced = os.environ.get("VLITE_ATTENTION_BACKEND", "").strip().upper()
    if forced and forced not in BACKENDS:
        raise ValueError(f"VLITE_ATTENTION_BACKEND must be one of {BACKENDS}, got {forced!r}")
    if forced == "TORCH_SDPA" and device.type != "cpu":
        raise ValueError("VLITE_ATTENTION_BACKEND=TORCH_SDPA runs on the CPU only")
    if device.type == "cpu" and forced != "TRITON_ATTN":
        return TorchSDPABackend
    if device.type in ("cuda", "cpu"):
        try:
            from vlite.attention.backends.triton_attn import TritonAttentionBackend
        except ImportError as e:
            raise ImportError(f"the Triton attention backend (device='cuda') needs triton ({e}); "
                              "install vlite's `gpu` extra") from e
        return TritonAttentionBackend
    raise ValueError(f"no attention backend for device {device.type!r}; device must be 'cpu' or 'cuda'")


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: Any, scale: float, window: int = 0, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """query [T, H, D], key/value [T, H_kv, D] (None: already in the cache) -> [T, H, D], through the backend that
    built `metadata`; `sinks`: float32 [H] attention sinks (gpt-oss), or None."""
    if isinstance(metadata, torch_sdpa.TorchSDPAMetadata):
        return torch_sdpa.paged_attention(query, key, value, kv_cache, metadata, scale, window, softcap, sinks)
    return metadata.paged_attention(query, key, value, kv_cache, scale, window, softcap, sinks)

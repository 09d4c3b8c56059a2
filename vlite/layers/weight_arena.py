"""Packed weights in 2 MiB pages (Linux transparent huge pages), for the CPU kernels.

A decode step reads every weight once (~96 MB for SmolLM2-135M Q4_1): with 4 KiB pages that is
~24,000 pages, far more than the TLB holds, so the pass pays page walks and the hardware prefetchers
stop at every 4 KiB boundary. Weights copied into 2 MiB-aligned anonymous memory advised
MADV_HUGEPAGE get 2 MiB pages where the kernel allows them (`enabled` = always or madvise): the
same pass measured 3.49 vs 4.00 ms for the 121 linear layers of a 1-token step (docs/benchmarks.md).

`place(t)` copies a tensor into the current chunk (64 MiB of address space, backed as it is
written) and returns the copy; a chunk is unmapped when no tensor in it is left. Elsewhere (no
MADV_HUGEPAGE, or VLITE_HUGE_PAGES=0) it returns the tensor unchanged.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Optional

import torch

ENV_VAR = "VLITE_HUGE_PAGES"
HUGE_PAGE = 2 << 20
CHUNK = 64 << 20
MIN_BYTES = 64 << 10  # smaller tensors (norms, biases, scales of tiny layers) stay where they are
ALIGN = 64


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false",
                                                                                                  "no", "off")


class _Arena:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: Optional[torch.Tensor] = None  # uint8 view of the current mapping, 2 MiB aligned
        self._offset = 0

    def _new_chunk(self, nbytes: int) -> None:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        start = (-ctypes.addressof(ctypes.c_char.from_buffer(mapping))) % HUGE_PAGE
        # The tensor holds the mapping (its buffer) alive; slices of it hold the tensor's storage.
        self._chunk = torch.frombuffer(mapping, dtype=torch.uint8)[start:start + size]
        self._offset = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes < MIN_BYTES or not enabled():
            return t
        padded = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            if self._chunk is None or self._offset + padded > self._chunk.numel():
                self._new_chunk(max(CHUNK, padded))
            assert self._chunk is not None
            out = self._chunk[self._offset:self._offset + nbytes]
            self._offset += padded
        out = out.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


_arena = _Arena()


def place(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous CPU tensor `t` in huge-page memory (or `t` itself where there is none)."""
    return _arena.place(t.contiguous())

"""Packed weights in 2 MiB pages (Linux transparent huge pages), for the CPU kernels.

A decode step reads every weight once (~96 MB for SmolLM2-135M Q4_1): with 4 KiB pages that is
~24,000 pages, far more than the TLB holds, so the pass pays page walks and the hardware prefetchers
stop at every 4 KiB boundary. Weights copied into 2 MiB-aligned anonymous memory advised
MADV_HUGEPAGE get 2 MiB pages where the kernel allows them (`enabled` = always or madvise): the
same pass measured 3.49 vs 4.00 ms for the 121 linear layers of a 1-token step (docs/perf-log.md).

`place(t)` copies a tensor into the current chunk (64 MiB of address space, backed as it is
written) and returns the copy; a chunk is unmapped when no tensor in it is left. Elsewhere (no
MADV_HUGEPAGE, or VLITE_HUGE_PAGES=0) it returns the tensor unchanged. `own_buffer` maps memory of its own
for what is dropped while serving (a LoRA adapter: 4 KiB pages cost its single-stream decode 0.83 -> 0.80x).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    import numpy as np

ENV_VAR = "VLITE_HUGE_PAGES"
HUGE_PAGE = 2 << 20
CHUNK = 64 << 20
MIN_BYTES = 64 << 10  # smaller tensors (norms, biases, scales of tiny layers) stay where they are
ALIGN = 64


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false",
                                                                                                  "no", "off")


def _huge_mapping(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of at least `nbytes` over an anonymous mapping of its own, 2 MiB aligned and advised
    MADV_HUGEPAGE; the tensor holds the mapping (its buffer) alive, and slices of it hold the tensor's storage:
    the mapping is unmapped when the last of them goes."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    start = (-ctypes.addressof(ctypes.c_char.from_buffer(mapping))) % HUGE_PAGE
    return torch.frombuffer(mapping, dtype=torch.uint8)[start:start + size]


class _Arena:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: Optional[torch.Tensor] = None  # uint8 view of the current mapping, 2 MiB aligned
        self._offset = 0

    def _new_chunk(self, nbytes: int) -> None:
        self._chunk = _huge_mapping(nbytes)
        self._offset = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes < MIN_BYTES or not enabled():
            return torch.empty(shape, dtype=dtype)
        padded = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            if self._chunk is None or self._offset + padded > self._chunk.numel():
                self._new_chunk(max(CHUNK, padded))
            assert self._chunk is not None
            out = self._chunk[self._offset:self._offset + nbytes]
            self._offset += padded
        return out.view(dtype).view(shape)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or not enabled():
            return t
        out = self.empty(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out


_arena = _Arena()


def place(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous CPU tensor `t` in huge-page memory (or `t` itself where there is none)."""
    return _arena.place(t.contiguous())


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor in huge-page memory (a plain one where there is none)."""
    return _arena.empty(shape, dtype)


def own_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor in huge-page memory of its own (not the arena's shared chunks), given back
    to the system whole when it and its views are dropped: what is loaded and unloaded while serving (a LoRA
    adapter's matrices). A plain tensor where there are no huge pages, or where it is small."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(numel, dtype=dtype)
    return _huge_mapping(nbytes)[:nbytes].view(dtype)


# Read-only memory maps of model files (the GGUF a loader reads): ranges whose pages may be given back
# once their tensors are tiled (release_file_pages). Only these: MADV_DONTNEED on anonymous memory
# would zero it. An entry goes when its mapping does.
_FILE_MAPS: dict[int, tuple[int, int, str]] = {}
_MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE


def register_file_map(array: "np.ndarray", path: str) -> None:
    """Mark a read-only numpy memmap of a whole file: views of it may have their pages released."""
    import weakref

    start = array.ctypes.data
    key = id(array)
    _FILE_MAPS[key] = (start, start + array.nbytes, os.path.realpath(path))
    weakref.finalize(array, _FILE_MAPS.pop, key, None)


def file_offset(t: torch.Tensor) -> Optional[tuple[str, int]]:
    """(file, byte offset) of `t`'s data where it is a view of a registered file map, else None."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    for lo, hi, path in _FILE_MAPS.values():
        if lo <= start and end <= hi:
            return path, start - lo
    return None


def release_file_pages(t: torch.Tensor) -> None:
    """Take the whole pages of `t`'s bytes out of this process's memory if they are a registered file
    map's (they were read: the weights are tiled elsewhere); a later read maps them in again from the
    page cache. Anything else: nothing."""
    if file_offset(t) is None:
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)

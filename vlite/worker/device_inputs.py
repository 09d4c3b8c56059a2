"""A step's int64 input arrays, built by the runner on the CPU, as tensors on the model's device.

On the CPU they are the arrays themselves (torch.from_numpy: no copy). On a GPU they are packed
into one pinned host buffer and sent with one non-blocking copy, then split into views:

    pinned [ input_ids | positions | query_start_loc | seq_lens | block_table | slot_mapping | ... ]
       -- one cudaMemcpyAsync -->  device buffer, viewed per array in its own shape

The pinned buffer is reused across steps; before it is overwritten, the previous step's copy is
waited for (a CUDA event), so a step without sampling (no read-back) cannot race the next one.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class DeviceInputs:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: Optional[torch.Tensor] = None
        self._copied: Optional[torch.cuda.Event] = None

    def __call__(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """name -> int64 array, to name -> tensor of the same shape on the device."""
        if self.device.type == "cpu":
            return {name: torch.from_numpy(a) for name, a in arrays.items()}
        for name, a in arrays.items():
            assert a.dtype == np.int64, f"{name} must be int64, got {a.dtype}"
        total = sum(a.size for a in arrays.values())
        if self._copied is not None:
            self._copied.synchronize()
        if self._pinned is None or self._pinned.numel() < total:
            self._pinned = torch.empty(max(total, 2 * (0 if self._pinned is None else self._pinned.numel())),
                                       dtype=torch.int64, pin_memory=True)
        host = self._pinned[:total]
        flat = host.numpy()
        offset = 0
        for a in arrays.values():
            flat[offset:offset + a.size] = a.ravel()
            offset += a.size
        dev = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        out, offset = {}, 0
        for name, a in arrays.items():
            out[name] = dev[offset:offset + a.size].view(a.shape)
            offset += a.size
        return out

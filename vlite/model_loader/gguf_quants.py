"""GGUF quantized tensors -> vlite's packed layouts (vlite/layers/packed.py), without changing a weight.

`to_packed(data, qtype, (N, K))` takes the raw bytes of one GGUF tensor, as `gguf.GGUFReader` hands
them out (`tensor.data`, `tensor.tensor_type`; shape reversed from GGUF's fastest-first dims), and
returns a `PackedTensors` whose `dequantize(torch.float32)` equals `gguf.quants.dequantize(data, qtype)`:

    Q4_0, Q4_K, Q5_K, Q6_K  -> the file's own bytes ("q4_0", ...: read at the file's size by the kernels,
                               vlite/layers/gguf_blocks.py)
    Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4  -> the same ("q2_k", ...: vlite/layers/gguf_low_bits.py)
    Q4_1  -> q4, f16 scales d, f16 mins m (nibbles copied as they are)
    Q8_0  -> q8, f16 scales d
    Q5_0  -> q8 (q - 16), f16 scales d
    Q5_1  -> q8 (q in 0..31), f16 scales d, f16 mins m

Exactness: every product of a 16-bit float scale with the small integers involved (sub-scales up to
6/8 bits, quants up to 6 bits) has at most 24 significant bits, so it is exact in float32; the only
rounding is the final "+ min", which gguf performs on the very same two float32 operands
(x - y is x + (-y) in IEEE arithmetic). Results are therefore bit-identical, with one harmless
exception: Q4_0 with a negative d and q == 8 gives -0.0 in gguf (d * 0) but +0.0 here (8d + -8d).
The values are equal (-0.0 == +0.0); only the sign bit of zero differs.

Everything is vectorized over blocks with numpy. The GGUF types kept as they are (Q4_0, K-quants) are
views of `data` (the loader's memory map of the file: no copy; the kernels tile them at load); the
converted ones own fresh, writable memory.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from vlite.layers.gguf_blocks import BLOCKS, COMPACT, q5_values, sub_of
from vlite.layers.packed import QK, PackedTensors

if TYPE_CHECKING:
    import gguf

SUPPORTED_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                    "IQ4_NL", "IQ4_XS", "MXFP4")
DENSE_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")


def readonly_view(a: np.ndarray) -> torch.Tensor:
    """A torch tensor over `a`'s memory, read-only arrays included (nothing writes into weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(a)


def _t(a: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor owning a fresh contiguous copy of `a`, reshaped."""
    return torch.from_numpy(np.array(a, copy=True, order="C").reshape(shape))


def to_packed(data: np.ndarray, qtype: "gguf.GGMLQuantizationType", shape: tuple[int, int]) -> Optional[PackedTensors]:
    """Convert one GGUF tensor's raw data to vlite's packed layout, bit-exactly (see module docstring).

    shape = (N, K) in row-major (numpy) order, i.e. reversed GGUF dims. Returns None for the dense types
    (F32, F16, BF16); raises ValueError naming the type for any other type this module cannot read."""
    name = getattr(qtype, "name", str(qtype))
    if name in DENSE_TYPES:
        return None
    if name not in BLOCKS:
        raise ValueError(f"GGUF tensor type {name} cannot be converted to vlite's packed weights "
                         f"(supported: {', '.join(SUPPORTED_TYPES)}; dense: {', '.join(DENSE_TYPES)})")
    block, bdt = BLOCKS[name]
    n, k = (int(s) for s in shape)
    if k % block:
        raise ValueError(f"{name} tensor of shape {(n, k)}: K={k} is not a multiple of the block size {block}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    nb = n * k // block
    if raw.size != nb * bdt.itemsize:
        raise ValueError(f"{name} tensor of shape {(n, k)} needs {nb * bdt.itemsize} bytes, got {raw.size}")
    if name.lower() in COMPACT:  # the file's bytes as they are: a view of `data` (the loader's memory map)
        return PackedTensors(name.lower(), readonly_view(raw.reshape(n, raw.size // n)), None, None,
                             sub_of(name.lower()))
    blk = raw.view(bdt)  # [nb] structured
    with np.errstate(invalid="ignore", over="ignore"):  # no warnings for inf/nan scale fields (garbage in: no exactness promise)
        return _convert(name, blk, n, k)


def _convert(name: str, blk: np.ndarray, n: int, k: int) -> PackedTensors:
    if name == "Q4_1":
        return PackedTensors("q4", _t(blk["qs"], (n, k // 2)), _t(blk["d"], (n, k // QK)), _t(blk["m"], (n, k // QK)))
    if name == "Q8_0":
        return PackedTensors("q8", _t(blk["qs"], (n, k)), _t(blk["d"], (n, k // QK)), None)
    # Q5_0, Q5_1
    q = q5_values(blk["qs"], blk["qh"])
    scales = _t(blk["d"], (n, k // QK))
    if name == "Q5_0":  # w = d * (q - 16)
        return PackedTensors("q8", _t(q.view(np.int8) - np.int8(16), (n, k)), scales, None)
    return PackedTensors("q8", _t(q.view(np.int8), (n, k)), scales, _t(blk["m"], (n, k // QK)))

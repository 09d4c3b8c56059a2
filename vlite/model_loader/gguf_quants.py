"""GGUF quantized tensors -> vlite's packed layouts (vlite/layers/packed.py), without changing a weight.

`to_packed(data, qtype, (N, K))` takes the raw bytes of one GGUF tensor, as `gguf.GGUFReader` hands
them out (`tensor.data`, `tensor.tensor_type`; shape reversed from GGUF's fastest-first dims), and
returns a `PackedTensors` whose `dequantize(torch.float32)` equals `gguf.quants.dequantize(data, qtype)`:

    Q4_0  -> q4, f16 scales d, f16 mins -8d (f32 for both if 8|d| overflows f16)
    Q4_1  -> q4, f16 scales d, f16 mins m (nibbles copied as they are)
    Q8_0  -> q8, f16 scales d
    Q5_0  -> q8 (q - 16), f16 scales d
    Q5_1  -> q8 (q in 0..31), f16 scales d, f16 mins m
    Q4_K  -> q4, f32 scales d*sc, f32 mins -dmin*m per 32 (nibbles rearranged to q4's per-32 order)
    Q5_K  -> q8 (q in 0..31), f32 scales d*sc, f32 mins -dmin*m per 32
    Q6_K  -> q8 (q - 32), sub=16, f32 scales d*sc

Exactness: every product of a 16-bit float scale with the small integers involved (sub-scales up to
6/8 bits, quants up to 6 bits) has at most 24 significant bits, so it is exact in float32; the only
rounding is the final "+ min", which gguf performs on the very same two float32 operands
(x - y is x + (-y) in IEEE arithmetic). Results are therefore bit-identical, with one harmless
exception: Q4_0 with a negative d and q == 8 gives -0.0 in gguf (d * 0) but +0.0 here (8d + -8d).
The values are equal (-0.0 == +0.0); only the sign bit of zero differs.

Everything is vectorized over blocks with numpy; the returned tensors own fresh, writable memory
(never views of the file's read-only memory map).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from vlite.layers.packed import QK, PackedTensors

if TYPE_CHECKING:
    import gguf

QK_K = 256  # values per K-quant super-block

SUPPORTED_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
DENSE_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")

# Block layouts (little-endian, as in ggml-common.h / gguf.constants.GGML_QUANT_SIZES).
_BLOCKS: dict[str, tuple[int, np.dtype]] = {
    "Q4_0": (32, np.dtype([("d", "<f2"), ("qs", "u1", 16)])),
    "Q4_1": (32, np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])),
    "Q5_0": (32, np.dtype([("d", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)])),
    "Q5_1": (32, np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)])),
    "Q8_0": (32, np.dtype([("d", "<f2"), ("qs", "i1", 32)])),
    "Q4_K": (QK_K, np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])),
    "Q5_K": (QK_K, np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32),
                             ("qs", "u1", 128)])),
    "Q6_K": (QK_K, np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])),
}

_F16_MAX = float(np.finfo(np.float16).max)


def _t(a: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor owning a fresh contiguous copy of `a`, reshaped."""
    return torch.from_numpy(np.array(a, copy=True, order="C").reshape(shape))


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _q5_values(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: [nb, 16] nibble bytes + [nb, 4] high-bit bytes (a little-endian uint32 whose bit j is
    value j's bit 4) -> [nb, 32] uint8 values 0..31."""
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # value j (j < 16) low nibble, value j+16 high
    high = np.unpackbits(qh, axis=-1, bitorder="little")  # [nb, 32], bit j of the uint32
    return low | (high << 4)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes of packed 6-bit sub-scales and sub-mins -> ([nb, 8], [nb, 8]) uint8.

    Bytes 0..3 hold scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7; bytes 4..7 likewise for
    mins; bytes 8..11 hold the low 4 bits of scales 4..7 (low nibble) and mins 4..7 (high nibble)."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: [nb, 128] nibble bytes -> [nb, 256] uint8 values 0..15.

    Each 32-byte group g holds values 64g + i (low nibble of byte i) and 64g + 32 + i (high nibble)."""
    nb = qs.shape[0]
    g = qs.reshape(nb, 4, 1, 32)
    return np.concatenate([g & 0x0F, g >> 4], axis=2).reshape(nb, QK_K)


def _k_to_q4(qs: np.ndarray) -> np.ndarray:
    """Q4_K's [nb, 128] nibble bytes -> q4's order (per 32 values: byte j = value j | value j+16 << 4)."""
    nb = qs.shape[0]
    b = qs.reshape(nb, 4, 2, 16)  # group g, bytes 0..15 / 16..31 of the group
    lo, hi = b[:, :, 0, :], b[:, :, 1, :]
    even = (lo & 0x0F) | (hi << 4)  # sub-block 2g: the group's low nibbles
    odd = (lo >> 4) | (hi & 0xF0)  # sub-block 2g+1: the group's high nibbles
    return np.stack([even, odd], axis=2).reshape(nb, QK_K // 2)


def to_packed(data: np.ndarray, qtype: "gguf.GGMLQuantizationType", shape: tuple[int, int]) -> Optional[PackedTensors]:
    """Convert one GGUF tensor's raw data to vlite's packed layout, bit-exactly (see module docstring).

    shape = (N, K) in row-major (numpy) order, i.e. reversed GGUF dims. Returns None for the dense types
    (F32, F16, BF16); raises ValueError naming the type for any other type this module cannot read."""
    name = getattr(qtype, "name", str(qtype))
    if name in DENSE_TYPES:
        return None
    if name not in _BLOCKS:
        raise ValueError(f"GGUF tensor type {name} cannot be converted to vlite's packed weights "
                         f"(supported: {', '.join(SUPPORTED_TYPES)}; dense: {', '.join(DENSE_TYPES)})")
    block, bdt = _BLOCKS[name]
    n, k = (int(s) for s in shape)
    if k % block:
        raise ValueError(f"{name} tensor of shape {(n, k)}: K={k} is not a multiple of the block size {block}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    nb = n * k // block
    if raw.size != nb * bdt.itemsize:
        raise ValueError(f"{name} tensor of shape {(n, k)} needs {nb * bdt.itemsize} bytes, got {raw.size}")
    blk = raw.view(bdt)  # [nb] structured
    with np.errstate(invalid="ignore", over="ignore"):  # no warnings for inf/nan scale fields (garbage in: no exactness promise)
        return _convert(name, blk, n, k)


def _convert(name: str, blk: np.ndarray, n: int, k: int) -> PackedTensors:
    if name in ("Q4_0", "Q4_1"):
        d = blk["d"]
        qs = _t(blk["qs"], (n, k // 2))
        if name == "Q4_1":
            return PackedTensors("q4", qs, _t(d, (n, k // QK)), _t(blk["m"], (n, k // QK)))
        # w = d * (q - 8) = d * q + (-8 d). Scaling by 8 is exact unless it overflows float16.
        m32 = _f32(d) * np.float32(-8.0)
        finite = np.isfinite(m32)
        if np.any(np.abs(m32[finite]) > _F16_MAX):
            return PackedTensors("q4", qs, _t(_f32(d), (n, k // QK)), _t(m32, (n, k // QK)))
        return PackedTensors("q4", qs, _t(d, (n, k // QK)), _t(m32.astype(np.float16), (n, k // QK)))

    if name == "Q8_0":
        return PackedTensors("q8", _t(blk["qs"], (n, k)), _t(blk["d"], (n, k // QK)), None)

    if name in ("Q5_0", "Q5_1"):
        q = _q5_values(blk["qs"], blk["qh"])
        scales = _t(blk["d"], (n, k // QK))
        if name == "Q5_0":  # w = d * (q - 16)
            return PackedTensors("q8", _t(q.view(np.int8) - np.int8(16), (n, k)), scales, None)
        return PackedTensors("q8", _t(q.view(np.int8), (n, k)), scales, _t(blk["m"], (n, k // QK)))

    if name in ("Q4_K", "Q5_K"):
        # w = (d * sc) * q - (dmin * m) per 32 values; both products computed in float32 as gguf does.
        sc, mn = _k_scale_min(blk["scales"])
        d = _f32(blk["d"])[:, None]
        dmin = _f32(blk["dmin"])[:, None]
        scales = _t(d * _f32(sc), (n, k // QK))
        mins = _t(-(dmin * _f32(mn)), (n, k // QK))
        if name == "Q4_K":
            return PackedTensors("q4", _t(_k_to_q4(blk["qs"]), (n, k // 2)), scales, mins)
        nbk = blk.shape[0]
        high = (blk["qh"].reshape(nbk, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = _k_nibbles(blk["qs"]) | (high.reshape(nbk, QK_K) << 4)  # bit b of qh[i]: value 32b + i
        return PackedTensors("q8", _t(q.view(np.int8), (n, k)), scales, mins)

    # Q6_K: w = (d * sc) * (q - 32) per 16 values. Per half h (128 values): ql byte i (0..63) holds values
    # 128h + i (low nibble) and 128h + 64 + i (high); qh byte i (0..31) holds bits 4-5 of values
    # 128h + 32s + i at bits 2s..2s+1.
    nbk = blk.shape[0]
    ql = blk["ql"].reshape(nbk, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(nbk, QK_K)
    qh = blk["qh"].reshape(nbk, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (qh & 0x03).reshape(nbk, QK_K)
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    scales = _f32(blk["d"])[:, None] * _f32(blk["scales"])
    return PackedTensors("q8", _t(q, (n, k)), _t(scales, (n, k // 16)), None, sub=16)

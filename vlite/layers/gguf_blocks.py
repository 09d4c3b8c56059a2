"""GGUF's block types, read with numpy: their byte layouts, their values, and the kernels' compact tiles.

Q4_0, Q4_K, Q5_K and Q6_K weights (the bulk of Q4_0, Q4_K_M, Q5_K_M and Q6_K files) are kept in the
file's own bytes (`PackedTensors` fmt "q4_0", "q4_k", "q5_k", "q6_k": one row of blocks per output
row), and the kernels read them re-tiled at the file's size (`tile`): 16 rows per tile, the 4-bit
part of every weight in q4's tile order, the 1 or 2 high bits in a plane beside it, and each
super-block's scales as the file stores them (float16 d, dmin; 6-bit sub-scales and sub-mins; int8
sub-scales), decoded by the kernel. A weight's value is the file's:

    Q4_0  w = d * (q - 8)                       q 4 bits, d float16 per 32
    Q4_K  w = (d * sc_j) * q - dmin * m_j       q 4 bits, sc/m 6 bits per 32, d/dmin float16 per 256
    Q5_K  as Q4_K with q 5 bits
    Q6_K  w = (d * sc_j) * (q - 32)             q 6 bits, sc int8 per 16, d float16 per 256

Bytes per 256 weights, file = tiles: Q4_0 144, Q4_K 144, Q5_K 176, Q6_K 210.

Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 are kept the same way; their values and tiles are in
vlite/layers/gguf_low_bits.py.
"""

from __future__ import annotations

import numpy as np

from vlite.layers import gguf_low_bits

QK = 32  # values per block (and per q4/q8 block of the kernels)
QK_K = 256  # values per K-quant super-block
TILE = 16  # output rows per tile (vlite/layers/packed.py)

# Block layouts (little-endian, as in ggml-common.h / gguf.constants.GGML_QUANT_SIZES).
BLOCKS: dict[str, tuple[int, np.dtype]] = {
    "Q4_0": (32, np.dtype([("d", "<f2"), ("qs", "u1", 16)])),
    "Q4_1": (32, np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])),
    "Q5_0": (32, np.dtype([("d", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)])),
    "Q5_1": (32, np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)])),
    "Q8_0": (32, np.dtype([("d", "<f2"), ("qs", "i1", 32)])),
    "Q4_K": (QK_K, np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])),
    "Q5_K": (QK_K, np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32),
                             ("qs", "u1", 128)])),
    "Q6_K": (QK_K, np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])),
    **gguf_low_bits.BLOCKS,
}

# Types kept in the file's bytes, with the kernels' format code: GGML's type id.
COMPACT: dict[str, int] = {"q4_0": 2, "q4_k": 12, "q5_k": 13, "q6_k": 14, **gguf_low_bits.CODES}
HIGH_BITS = {"q4_0": 0, "q4_k": 0, "q5_k": 1, "q6_k": 2}  # bits of each weight past the low 4

# A tile's super-block scales as the kernels read them (per 16 rows: lane l is row l of the tile)
_K_SCALES = np.dtype([("d", "<f2", TILE), ("dmin", "<f2", TILE), ("lo_sc", "<u4", TILE), ("lo_mn", "<u4", TILE),
                      ("hi", "<u4", TILE)])  # 256 bytes: 16 per row, as the file's d, dmin and 12 bytes
_Q6_SCALES = np.dtype([("d", "<f2", TILE), ("sc", "i1", (16, TILE))])  # 288 bytes: 18 per row, as the file


def sub_of(fmt: str) -> int:
    """Inputs per scale of a compact fmt: 16 (Q6_K, Q2_K, Q3_K) or 32."""
    return 16 if fmt == "q6_k" else gguf_low_bits.SUB.get(fmt, QK)


def block_of(fmt: str) -> tuple[int, np.dtype]:
    """(values per block, block dtype) of a compact fmt ("q4_k") or a GGUF type name ("Q4_K")."""
    return BLOCKS[fmt.upper()]


def blocks(raw: np.ndarray, fmt: str, n: int) -> np.ndarray:
    """[n, row bytes] uint8 -> [n, blocks per row] structured blocks."""
    _, bdt = block_of(fmt)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1).view(bdt)


def q5_values(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: [..., 16] nibble bytes + [..., 4] high-bit bytes (a little-endian uint32 whose bit j is
    value j's bit 4) -> [..., 32] uint8 values 0..31."""
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # value j (j < 16) low nibble, value j+16 high
    high = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32], bit j of the uint32
    return low | (high << 4)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: [..., 12] bytes of packed 6-bit sub-scales and sub-mins -> ([..., 8], [..., 8]) uint8.

    Bytes 0..3 hold scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7; bytes 4..7 likewise for
    mins; bytes 8..11 hold the low 4 bits of scales 4..7 (low nibble) and mins 4..7 (high nibble)."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: [..., 128] nibble bytes -> [..., 256] uint8 values 0..15.

    Each 32-byte group g holds values 64g + i (low nibble of byte i) and 64g + 32 + i (high nibble)."""
    g = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([g & 0x0F, g >> 4], axis=-2).reshape(*qs.shape[:-1], QK_K)


def q6_values(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K: [..., 128] low-nibble bytes + [..., 64] high-bit bytes -> [..., 256] uint8 values 0..63.

    Per half h (128 values): ql byte i (0..63) holds values 128h + i (low nibble) and 128h + 64 + i
    (high); qh byte i (0..31) holds bits 4-5 of values 128h + 32s + i at bits 2s..2s+1."""
    lead = ql.shape[:-1]
    q = ql.reshape(*lead, 2, 1, 64)
    low = np.concatenate([q & 0x0F, q >> 4], axis=-2).reshape(*lead, QK_K)
    h = qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    return low | ((h & 0x03).reshape(*lead, QK_K) << 4)


def k_values(blk: np.ndarray, fmt: str) -> np.ndarray:
    """Q4_K/Q5_K structured blocks [..., nsb] -> [..., nsb, 256] uint8 values (Q5_K: bit b of qh[i] is
    value 32b + i's bit 4)."""
    q = k_nibbles(blk["qs"])
    if fmt == "q5_k":
        q = q | (((blk["qh"][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*q.shape) << 4)
    return q


def values(raw: np.ndarray, fmt: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """A compact tensor's integers and float32 scales: (q uint8 [n, k], scales [n, k/sub], mins [n, k/32]
    or None, sub), with w = scale * q + min per block (Q6_K: scale * (q - 32), q returned less 32 as int8;
    gguf_low_bits.values for its types: Q2_K's mins per 16).

    Every product is computed in float32 as gguf does (exact: 16-bit floats times small integers)."""
    blk = blocks(raw, fmt, n)
    if fmt in gguf_low_bits.CODES:
        return gguf_low_bits.values(blk, fmt, n, k)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/nan scale fields: garbage in, no promise
        if fmt == "q4_0":
            q = np.concatenate([blk["qs"] & 0x0F, blk["qs"] >> 4], axis=-1).reshape(n, k)
            d = blk["d"].astype(np.float32)
            return q, d, d * np.float32(-8.0), QK
        if fmt in ("q4_k", "q5_k"):
            sc, mn = k_scale_min(blk["scales"])
            q = k_values(blk, fmt)
            d = blk["d"].astype(np.float32)[..., None]
            dmin = blk["dmin"].astype(np.float32)[..., None]
            return (q.reshape(n, k), (d * sc.astype(np.float32)).reshape(n, -1),
                    (-(dmin * mn.astype(np.float32))).reshape(n, -1), QK)
        if fmt == "q6_k":
            q = (q6_values(blk["ql"], blk["qh"]).view(np.int8) - np.int8(32)).reshape(n, k)
            scales = blk["d"].astype(np.float32)[..., None] * blk["scales"].astype(np.float32)
            return q, scales.reshape(n, -1), None, 16
    raise ValueError(f"not a compact GGUF format: {fmt!r} (compact: {', '.join(COMPACT)})")


def nibble_bytes(q: np.ndarray) -> np.ndarray:
    """[n, k] values (their low 4 bits) -> q4's row order: per 32, byte j = value j | value j+16 << 4."""
    n, k = q.shape
    b = (q & 0x0F).reshape(n, k // QK, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)


def _by_tile(a: np.ndarray, tiles: int) -> np.ndarray:
    """[rows, ...] -> [tiles, 16, ...] with zero rows past the end."""
    pad = tiles * TILE - a.shape[0]
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
    return a.reshape(tiles, TILE, *a.shape[1:])


def tile_nibbles(q4: np.ndarray, n: int, k: int) -> np.ndarray:
    """q4 row-order bytes [n, k/2] -> the kernels' tiles [tiles, k/32 * 256]: per block, chunk p (bytes
    4p..4p+3: inputs 4p.. low, 16+4p.. high) of rows 0..15 side by side."""
    tiles = -(-n // TILE)
    t = _by_tile(q4.reshape(n, k // QK, 4, 4), tiles)  # [tiles, 16, nb, 4 chunks, 4]
    return np.ascontiguousarray(t.transpose(0, 2, 3, 1, 4)).reshape(tiles, -1)


def _high_plane(q: np.ndarray, bits: int, tiles: int) -> np.ndarray:
    """Each weight's bits 4.. as the kernels read them, [tiles, k/32 * 16 * 4 * bits] uint8. Per block, byte
    i of row l: 1 bit: bit p = high bit of input 4p + i (p 0..7); 2 bits: two such bytes, inputs 0..15
    then 16..31, bits 2p..2p+1 = the 2 high bits of input 16h + 4p + i (p 0..3)."""
    n, k = q.shape
    hi = (q >> 4).reshape(n, k // QK, 8, 4)  # [n, nb, p, i]: input 4p + i
    if bits == 1:
        shifts = np.arange(8, dtype=np.uint8).reshape(8, 1)
        plane = (hi << shifts).sum(axis=2, dtype=np.uint8)[:, :, None, :]  # [n, nb, 1, 4]
    else:
        h = hi.reshape(n, k // QK, 2, 4, 4)  # [n, nb, half, p, i]
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        plane = (h << shifts).sum(axis=3, dtype=np.uint8)  # [n, nb, half, 4]
    t = _by_tile(plane, tiles)  # [tiles, 16, nb, planes, 4]
    return np.ascontiguousarray(t.transpose(0, 2, 3, 1, 4)).reshape(tiles, -1)


def _lanes(a: np.ndarray, tiles: int) -> np.ndarray:
    """[rows, groups, ...] -> [tiles, groups, ..., 16]: each group's values of the tile's 16 rows side by side."""
    t = _by_tile(a, tiles)
    return np.ascontiguousarray(np.moveaxis(t, 1, -1))


def tile_shapes(fmt: str, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int, int], "torch.dtype"]:
    """The shapes of `tile`'s two arrays (qt, scales) and the scales' torch dtype."""
    import torch

    if fmt in gguf_low_bits.CODES:
        qt, st, dt = gguf_low_bits.tile_shapes(fmt, n, k)
        return qt, st, getattr(torch, dt)
    tiles = -(-n // TILE)
    qt = (tiles, k // QK * (256 + 64 * HIGH_BITS[fmt]))
    if fmt == "q4_0":
        return qt, (tiles, k // QK, TILE), torch.float16
    return qt, (tiles, k // QK_K, (_Q6_SCALES if fmt == "q6_k" else _K_SCALES).itemsize), torch.uint8


def tile(raw: np.ndarray, fmt: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A compact tensor's file bytes [n, row bytes] -> (qt uint8 [tiles, nibble tiles + high plane],
    st: Q4_0 float16 d [tiles, k/32, 16]; K-quants uint8 [tiles, k/256, 256 or 288] super-block scales).

    The reference for the kernels' own `tile_gguf` (vlite/csrc/cpu/gguf_tiles.cpp, used at load), and
    the layout where the kernels are not built."""
    tiles = -(-n // TILE)
    blk = blocks(raw, fmt, n)
    if fmt in gguf_low_bits.CODES:
        return gguf_low_bits.tile(blk, fmt, n, k)
    if fmt == "q4_0":
        return tile_nibbles(blk["qs"].reshape(n, k // 2), n, k), _lanes(blk["d"], tiles)
    if fmt == "q6_k":
        q = q6_values(blk["ql"], blk["qh"]).reshape(n, k)
        st = np.zeros((tiles, k // QK_K), _Q6_SCALES)
        st["d"] = _lanes(blk["d"], tiles)
        st["sc"] = _lanes(blk["scales"], tiles)
    else:
        q = k_values(blk, fmt).reshape(n, k)
        sc, mn = k_scale_min(blk["scales"])  # [n, nsb, 8]
        nib = np.arange(8, dtype=np.uint32) * 4
        st = np.zeros((tiles, k // QK_K), _K_SCALES)
        st["d"] = _lanes(blk["d"], tiles)
        st["dmin"] = _lanes(blk["dmin"], tiles)
        st["lo_sc"] = _lanes(((sc & 0x0F).astype(np.uint32) << nib).sum(axis=-1, dtype=np.uint32), tiles)
        st["lo_mn"] = _lanes(((mn & 0x0F).astype(np.uint32) << nib).sum(axis=-1, dtype=np.uint32), tiles)
        two = np.arange(8, dtype=np.uint32) * 2
        hi = (((sc >> 4).astype(np.uint32) << two) | ((mn >> 4).astype(np.uint32) << (two + 16))).sum(
            axis=-1, dtype=np.uint32)
        st["hi"] = _lanes(hi, tiles)
    qt = tile_nibbles(nibble_bytes(q), n, k)
    if HIGH_BITS[fmt]:
        qt = np.concatenate([qt, _high_plane(q, HIGH_BITS[fmt], tiles)], axis=1)
    return qt, st.view(np.uint8).reshape(tiles, k // QK_K, -1)

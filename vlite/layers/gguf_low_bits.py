"""GGUF's Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 read with numpy: their values, and the kernels' file-sized tiles.

Like Q4_K and the others of vlite/layers/gguf_blocks.py, weights of these types stay in the file's bytes
(`PackedTensors` fmt "q2_k", "q3_k", "iq4_nl", "iq4_xs", "mxfp4") and the kernels read them re-tiled at the
file's size (vlite/csrc/cpu/gguf_kinds.h has the layouts): Q2_K and Q3_K as a 2-bit plane (and a 1-bit plane),
the others as q4's nibble tiles whose nibble indexes a 16-value table (one byte shuffle in the kernels). Values:

    Q2_K    w = (d * sc_j) * q - dmin * m_j              q 2 bits, sc/m 4 bits per 16, d/dmin float16 per 256
    Q3_K    w = (d * (sc_j - 32)) * (q - 4)              q 3 bits, sc 6 bits per 16, d float16 per 256
    IQ4_NL  w = d * IQ4NL[q]                             q 4 bits, d float16 per 32
    IQ4_XS  w = (d * (ls_j - 32)) * IQ4NL[q]             q 4 bits, ls 6 bits per 32, d float16 per 256
    MXFP4   w = 2^(e - 128) * FP4[q]                     q 4 bits, e (E8M0) per 32; FP4: E2M1 values doubled

Bytes per 256 weights, file / tiles: Q2_K 84 / 84, Q3_K 110 / 114 (its sixteen 6-bit sub-scales as bytes),
IQ4_NL 144 / 144, IQ4_XS 136 / 136, MXFP4 136 / 136.
"""

from __future__ import annotations

import numpy as np

QK, QK_K, TILE = 32, 256, 16

BLOCKS: dict[str, tuple[int, np.dtype]] = {
    "Q2_K": (QK_K, np.dtype([("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2"), ("dmin", "<f2")])),
    "Q3_K": (QK_K, np.dtype([("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2")])),
    "IQ4_NL": (QK, np.dtype([("d", "<f2"), ("qs", "u1", 16)])),
    "IQ4_XS": (QK_K, np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", 4), ("qs", "u1", 128)])),
    "MXFP4": (QK, np.dtype([("e", "u1"), ("qs", "u1", 16)])),
}
CODES: dict[str, int] = {"q2_k": 10, "q3_k": 11, "iq4_nl": 20, "iq4_xs": 23, "mxfp4": 39}  # GGML's type ids
SUB = {"q2_k": 16, "q3_k": 16, "iq4_nl": QK, "iq4_xs": QK, "mxfp4": QK}  # inputs per scale
BITS = {"q2_k": 2, "q3_k": 3, "iq4_nl": 4, "iq4_xs": 4, "mxfp4": 4}  # bits per weight in the tiles

IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
FP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)

_Q2_SCALES = np.dtype([("d", "<f2", TILE), ("dmin", "<f2", TILE), ("sc", "u1", (16, TILE))])  # 320 bytes
_Q3_SCALES = np.dtype([("d", "<f2", TILE), ("sc", "i1", (16, TILE))])  # 288 bytes
_XS_SCALES = np.dtype([("d", "<f2", TILE), ("lo", "<u4", TILE), ("hi", "<u2", TILE)])  # 128 bytes


def low2(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K: [..., 64] bytes -> [..., 256] 2-bit values: value 128h + 32s + i at bits 2s of byte 32h + i."""
    g = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    return (g & 3).reshape(*qs.shape[:-1], QK_K)


def q3_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K: [..., 12] bytes -> [..., 16] int8 sub-scales less 32 (low 4 bits: nibble j // 8 of byte j % 8;
    top 2: bits 2(j // 4) of byte 8 + j % 4)."""
    lo = np.concatenate([scales[..., :8] & 0x0F, scales[..., :8] >> 4], axis=-1)
    hi = (scales[..., 8:12][..., None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    return ((lo | (hi.reshape(*scales.shape[:-1], 16) << 4)).astype(np.int16) - 32).astype(np.int8)


def xs_scales(blk: np.ndarray) -> np.ndarray:
    """IQ4_XS structured blocks -> [..., 8] sub-scales less 32 (int8)."""
    lo = np.stack([blk["scales_l"] & 0x0F, blk["scales_l"] >> 4], axis=-1).reshape(*blk.shape, 8)
    hi = (blk["scales_h"][..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    return ((lo | (hi.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponents -> float32 2^(e - 128) (ggml's halved convention; e < 2 as denormals)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16 m] bytes, Q4_0's order per 16 (byte j: value j low, value j + 16 high) -> [..., 32 m] nibbles."""
    b = qs.reshape(*qs.shape[:-1], -1, 1, 16)
    return np.concatenate([b & 0x0F, b >> 4], axis=-2).reshape(*qs.shape[:-1], -1)


def _u(blk: np.ndarray, fmt: str) -> np.ndarray:
    """Q2_K/Q3_K: the unsigned integers the tiles hold, [..., 256] (Q3_K: low 2 bits + 4 * hmask bit, 0..7)."""
    u = low2(blk["qs"])
    if fmt == "q3_k":  # bit j of hmask[i]: value 32j + i
        h = (blk["hmask"][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        u = u | (h.reshape(u.shape) << 2)
    return u


def table_indices(blk: np.ndarray) -> np.ndarray:
    """IQ4_NL/IQ4_XS/MXFP4 blocks -> [..., values per block] nibbles (table indices), natural order."""
    return _nibbles(blk["qs"])


def values(blk: np.ndarray, fmt: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """gguf_blocks.values for these types: (q [n, k], float32 scales [n, k/sub], mins [n, k/16] or None, sub),
    w = scale * q (+ min); q uint8 for Q2_K, int8 for the others (Q3_K's q - 4, the tables' values)."""
    with np.errstate(invalid="ignore", over="ignore"):
        if fmt in ("q2_k", "q3_k"):
            u = _u(blk, fmt).reshape(n, k)
            d = blk["d"].astype(np.float32)[..., None]
            if fmt == "q2_k":
                sc = blk["scales"]
                return (u, (d * (sc & 0x0F).astype(np.float32)).reshape(n, -1),
                        (-(blk["dmin"].astype(np.float32)[..., None] * (sc >> 4).astype(np.float32))).reshape(n, -1), 16)
            return (u.view(np.int8) - np.int8(4), (d * q3_scales(blk["scales"]).astype(np.float32)).reshape(n, -1),
                    None, 16)
        q = (FP4 if fmt == "mxfp4" else IQ4NL)[table_indices(blk)].reshape(n, k)
        if fmt == "iq4_nl":
            return q, blk["d"].astype(np.float32).reshape(n, -1), None, QK
        if fmt == "mxfp4":
            return q, e8m0_half(blk["e"]).reshape(n, -1), None, QK
        scales = blk["d"].astype(np.float32)[..., None] * xs_scales(blk).astype(np.float32)
        return q, scales.reshape(n, -1), None, QK


def tile_shapes(fmt: str, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int, int], str]:
    """The shapes of `tile`'s (qt, st) and the scales' dtype name."""
    tiles = -(-n // TILE)
    qt = (tiles, k // QK * 64 * BITS[fmt])
    if fmt in ("iq4_nl", "mxfp4"):
        return qt, (tiles, k // QK, TILE), "float16" if fmt == "iq4_nl" else "uint8"
    dt = {"q2_k": _Q2_SCALES, "q3_k": _Q3_SCALES, "iq4_xs": _XS_SCALES}[fmt]
    return qt, (tiles, k // QK_K, dt.itemsize), "uint8"


def tile(blk: np.ndarray, fmt: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' tiles of these types (gguf_kinds.h), the reference for the C++ tiler `tile_gguf`."""
    from vlite.layers.gguf_blocks import _by_tile, _lanes, nibble_bytes, tile_nibbles

    tiles, nb = -(-n // TILE), k // QK
    if fmt in ("q2_k", "q3_k"):
        u = _u(blk, fmt).reshape(n, nb, 2, 4, 4)  # [row, block, h, s, i]: input 4(4h + s) + i
        plane = ((u & 3) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)).sum(axis=3, dtype=np.uint8)
        qt = np.ascontiguousarray(_by_tile(plane, tiles).transpose(0, 2, 3, 1, 4)).reshape(tiles, -1)
        if fmt == "q3_k":  # bit j of byte i: input 4j + i's bit 2
            hi = (u.reshape(n, nb, 8, 4) >> 2) << np.arange(8, dtype=np.uint8).reshape(8, 1)
            hp = hi.sum(axis=2, dtype=np.uint8)[:, :, None, :]
            qt = np.concatenate([qt, np.ascontiguousarray(_by_tile(hp, tiles).transpose(0, 2, 3, 1, 4))
                                 .reshape(tiles, -1)], axis=1)
            st = np.zeros((tiles, k // QK_K), _Q3_SCALES)
            st["d"] = _lanes(blk["d"], tiles)
            st["sc"] = _lanes(q3_scales(blk["scales"]), tiles)
        else:
            st = np.zeros((tiles, k // QK_K), _Q2_SCALES)
            st["d"] = _lanes(blk["d"], tiles)
            st["dmin"] = _lanes(blk["dmin"], tiles)
            st["sc"] = _lanes(blk["scales"], tiles)
        return qt, st.view(np.uint8).reshape(tiles, k // QK_K, -1)
    qt = tile_nibbles(nibble_bytes(table_indices(blk).reshape(n, k)), n, k)
    if fmt == "iq4_nl":
        return qt, _lanes(blk["d"], tiles)
    if fmt == "mxfp4":
        return qt, _lanes(blk["e"], tiles)
    st = np.zeros((tiles, k // QK_K), _XS_SCALES)
    st["d"] = _lanes(blk["d"], tiles)
    st["lo"] = _lanes(np.ascontiguousarray(blk["scales_l"]).view("<u4")[..., 0], tiles)
    st["hi"] = _lanes(blk["scales_h"], tiles)
    return qt, st.view(np.uint8).reshape(tiles, k // QK_K, -1)

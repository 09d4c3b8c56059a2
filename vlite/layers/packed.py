"""The block-quantized weight layouts that vlite's CPU kernels read (vlite/csrc/cpu/quant_linear.cpp).

Weights are stored row by row (one row per output feature) in blocks of 32 consecutive inputs, as
GGUF files store them, with a scale (and optionally a min) per block:

    q4: qs uint8 [N, K/2]; in block b, byte j holds q[32b + j] (low nibble) and q[32b + j + 16]
        (high nibble), q in 0..15 (GGUF's Q4_0/Q4_1 order);  w = scale * q + min
    q8: qs int8 [N, K];                                        w = scale * q (+ min)

`scales` has one value per `sub` inputs (32, or 16 for Q6_K's sub-blocks), `mins` one per 32 (or
none). Scales are float16 where the source's are (Q4_0, Q4_1, Q8_0, ...: exact), float32 where a
scale is a product (K-quants: d * sub-scale). Every GGUF type the kernels read maps to one of these
two layouts without changing a single weight value.

GGUF's Q4_0, Q4_K, Q5_K and Q6_K (the bulk of the files people download) are kept as the file's own
bytes instead, fmt "q4_0", "q4_k", "q5_k", "q6_k" (vlite/layers/gguf_blocks.py), and so are Q2_K, Q3_K,
IQ4_NL, IQ4_XS and MXFP4 ("q2_k", ..., vlite/layers/gguf_low_bits.py; Q2_K's mins are per 16): converted to q4/q8
with float32 scales they would take 1.3-1.5x the file's size, and a decode step reads every byte.

The kernels read a row-tiled copy (`TiledTensors`, made once at load by `PackedTensors.tiled()`):
16 output rows per tile, and in each block the 4-input chunks of the 16 rows side by side, so that
one vector register holds the same inputs of many rows (see quant_linear.cpp); the GGUF types' tiles
are the file's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from vlite.layers import gguf_blocks, weight_arena

QK = 32  # inputs per block
TILE = 16  # output rows per tile of the kernels' layout


@dataclass
class PackedTensors:
    fmt: str  # "q4", "q8", or a GGUF type kept in the file's bytes: "q4_0", "q4_k", ..., "mxfp4" (gguf_blocks.COMPACT)
    qs: torch.Tensor  # q4: uint8 [N, K/2]; q8: int8 [N, K]; GGUF types: uint8 [N, the file's bytes per row]
    scales: Optional[torch.Tensor]  # float16 or float32 [N, K/sub]; None for the GGUF types (in their blocks)
    mins: Optional[torch.Tensor]  # same dtype as scales, [N, K/32], or None (zero, or in the GGUF blocks)
    sub: int = QK  # inputs per scale: 32, or 16 (q8 and q6_k)

    @property
    def layout(self) -> tuple:
        """What weights must share to be stacked into one (PackedTensors.cat)."""
        return self.fmt, self.sub, None if self.scales is None else self.scales.dtype, self.mins is None

    @property
    def compact(self) -> bool:
        """Kept in the GGUF file's own blocks."""
        return self.fmt in gguf_blocks.COMPACT

    @property
    def kernel_fmt(self) -> int:
        """The C++ kernels' name for the layout: 4 (q4), 8 (q8), or the GGUF type's id (gguf_blocks.COMPACT)."""
        return gguf_blocks.COMPACT[self.fmt] if self.compact else 4 if self.fmt == "q4" else 8

    @property
    def block(self) -> int:
        """Inputs per block: rows split into whole blocks only."""
        return gguf_blocks.block_of(self.fmt)[0] if self.compact else QK

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        if self.compact:
            block, bdt = gguf_blocks.block_of(self.fmt)
            return n, self.qs.shape[1] // bdt.itemsize * block
        return n, self.qs.shape[1] * (2 if self.fmt == "q4" else 1)

    def rows(self, index: torch.Tensor) -> PackedTensors:
        """The same weight with its rows reordered (GGUF's Q/K rotary permutation, fused QKV)."""
        out = PackedTensors(self.fmt, self.qs[index], None if self.scales is None else self.scales[index],
                            None if self.mins is None else self.mins[index], self.sub)
        weight_arena.release_file_pages(self.qs)  # copied out of the file's map
        return out

    def cols(self, start: int, end: int) -> PackedTensors:
        """Inputs [start, end) of every row (a row-parallel shard): whole blocks only (32 inputs; 256 for
        the K-quants), so every value and scale is kept as is."""
        n, k = self.shape
        if self.compact and (start % self.block or end % self.block) and not (start % QK or end % QK):
            return self.converted().cols(start, end)  # K-quant super-blocks split: the q4/q8 layout
        if start % QK or end % QK or not 0 <= start < end <= k:
            raise ValueError(f"packed columns [{start}, {end}) of a [{n}, {k}] weight must split at "
                             f"multiples of the block size {QK}")
        if self.compact:
            size = gguf_blocks.block_of(self.fmt)[1].itemsize
            return PackedTensors(self.fmt, self.qs[:, start // self.block * size:end // self.block * size].contiguous(),
                                 None, None, self.sub)
        per = 2 if self.fmt == "q4" else 1
        return PackedTensors(self.fmt, self.qs[:, start // per:end // per].contiguous(),
                             self.scales[:, start // self.sub:end // self.sub].contiguous(),
                             None if self.mins is None else self.mins[:, start // QK:end // QK].contiguous(), self.sub)

    def col_groups(self, order: torch.Tensor, unit: int) -> PackedTensors:
        """The same weight with its inputs reordered in groups of `unit`: group i of the result is group
        order[i] of this one (GGUF's head orders). Whole blocks move, every value and scale kept as is; a
        GGUF type whose blocks a group would split (K-quants' 256 inputs) is first converted to the q4/q8
        layout (32-input blocks, the same values); a group that splits even those is a ValueError."""
        n, k = self.shape
        groups = len(order)
        if groups * unit != k:
            raise ValueError(f"{groups} groups of {unit} inputs do not cover the {k} inputs of a [{n}, {k}] weight")
        if unit % QK:
            raise ValueError(f"packed inputs move in whole blocks of {QK}, not in groups of {unit}")
        if self.compact and unit % self.block:
            return self.converted().col_groups(order, unit)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n, groups, -1)[:, order].reshape(n, -1).contiguous()

        out = PackedTensors(self.fmt, pick(self.qs), None if self.scales is None else pick(self.scales),
                            None if self.mins is None else pick(self.mins), self.sub)
        weight_arena.release_file_pages(self.qs)  # copied out of the file's map
        return out

    @staticmethod
    def cat(parts: list[PackedTensors]) -> PackedTensors:
        """Stack along rows (fused QKV / gate-up); all parts must share one layout."""
        first = parts[0]
        if any(p.layout != first.layout for p in parts):
            raise ValueError("cannot fuse packed weights of different layouts")
        out = PackedTensors(first.fmt, torch.cat([p.qs for p in parts]),
                            None if first.scales is None else torch.cat([p.scales for p in parts]),
                            None if first.mins is None else torch.cat([p.mins for p in parts]), first.sub)
        for p in parts:  # copied out of the file's map
            weight_arena.release_file_pages(p.qs)
        return out

    def converted(self) -> PackedTensors:
        """A GGUF type's weights in the q4/q8 layout with float32 scales (the same values, 1.3-1.5x the bytes).
        Not Q2_K: its mins per 16 inputs have no place in those layouts (a ValueError)."""
        if not self.compact:
            return self
        n, k = self.shape
        if self.fmt == "q2_k":
            raise ValueError(f"a Q2_K weight [{n}, {k}] splits only at its 256-input super-blocks (its mins are per 16 "
                             "inputs, which the q4/q8 layouts have no place for)")
        q, scales, mins, sub = gguf_blocks.values(self.qs.numpy(), self.fmt, n, k)
        t = torch.from_numpy
        if self.fmt in ("q4_0", "q4_k"):
            return PackedTensors("q4", t(np.ascontiguousarray(gguf_blocks.nibble_bytes(q))), t(scales), t(mins), sub)
        return PackedTensors("q8", t(np.ascontiguousarray(q).view(np.int8)), t(scales),
                             None if mins is None else t(mins), sub)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight these values stand for (reference code: plain torch, float32 math)."""
        n, k = self.shape
        if self.compact:  # the file's values: q * scale (+ min) in float32, as gguf computes them
            q, scales, mins, sub = gguf_blocks.values(self.qs.numpy(), self.fmt, n, k)
            w = torch.from_numpy(q.astype(np.float32).reshape(n, k // sub, sub) * scales[..., None]).view(n, k)
            if mins is not None:
                msub = k // mins.shape[1]
                w = (w.view(n, k // msub, msub) + torch.from_numpy(mins)[..., None]).view(n, k)
            return w.to(dtype)
        if self.fmt == "q4":
            b = self.qs.view(n, k // QK, QK // 2)
            q = torch.cat([b & 0x0F, b >> 4], dim=-1).view(n, k).float()
        else:
            q = self.qs.float()
        w = q.view(n, k // self.sub, self.sub) * self.scales.float()[..., None]
        w = w.view(n, k)
        if self.mins is not None:
            w = (w.view(n, k // QK, QK) + self.mins.float()[..., None]).view(n, k)
        return w.to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def tiled(self) -> TiledTensors:
        """The kernels' row-tiled layout of these weights (every value unchanged).

        qt uint8 [tiles, K/32 * 16 * bytes per row-block]: per block, chunk j (4 inputs) of rows 0..15;
        q4 chunk p holds inputs 4p..4p+3 (low nibbles) and 16+4p.. (high), as GGUF's bytes 4p..4p+3
        do; q8 chunk j holds inputs 4j..4j+3 as w + 128 (uint8). Scales [tiles, K/sub, 16], mins
        [tiles, K/32, 16]; rows past N are zero padding.
        """
        n, k = self.shape
        if self.compact:  # the file's bytes re-tiled (vlite/layers/gguf_blocks.py), by the kernels where built
            from vlite import _custom_ops

            kernels = _custom_ops.load()
            if kernels is None:
                qt, st = gguf_blocks.tile(self.qs.numpy(), self.fmt, n, k)
                return TiledTensors(self.kernel_fmt, torch.from_numpy(qt), torch.from_numpy(st), None, self.sub, n, k)
            return _tile_gguf([self], kernels)
        tiles = -(-n // TILE)
        pad = tiles * TILE - n
        nb = k // QK
        qs = self.qs if self.fmt == "q4" else self.qs.view(torch.uint8) ^ 0x80
        chunks = 4 if self.fmt == "q4" else 8
        qs = torch.nn.functional.pad(qs, (0, 0, 0, pad))
        qt = qs.view(tiles, TILE, nb, chunks, 4).permute(0, 2, 3, 1, 4).reshape(tiles, -1).contiguous()

        def by_tile(t: torch.Tensor) -> torch.Tensor:
            t = torch.nn.functional.pad(t, (0, 0, 0, pad))
            return t.view(tiles, TILE, t.shape[1]).transpose(1, 2).contiguous()

        mins = None if self.mins is None else weight_arena.place(by_tile(self.mins))
        return TiledTensors(self.kernel_fmt, weight_arena.place(qt), weight_arena.place(by_tile(self.scales)), mins,
                            self.sub, n, k)


@dataclass
class StackedPacked:
    """GGUF-type weights of one layout stacked along rows (fused QKV, gate/up) without a copy: each part is
    tiled from the file's map into its own rows of one tiled buffer. `PackedTensors.cat` first copies the
    parts' bytes into a row-major buffer (for the 1B shape 360 MB of fresh pages, ~0.25 s of its start and
    as much extra peak memory). Parts of a whole number of tiles (16 rows) each; `stack` decides."""

    parts: list[PackedTensors]

    @staticmethod
    def stack(parts: list[PackedTensors]) -> PackedTensors | StackedPacked:
        """`parts` as one weight: a StackedPacked where they can be (GGUF types, whole tiles, the kernels built),
        else PackedTensors.cat."""
        from vlite import _custom_ops

        if len(parts) == 1:
            return parts[0]
        if (all(p.compact and p.layout == parts[0].layout and p.shape[0] % TILE == 0 for p in parts)
                and _custom_ops.load() is not None):
            return StackedPacked(list(parts))
        return PackedTensors.cat(parts)

    @property
    def fmt(self) -> str:
        return self.parts[0].fmt

    @property
    def sub(self) -> int:
        return self.parts[0].sub

    @property
    def kernel_fmt(self) -> int:
        return self.parts[0].kernel_fmt

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def tiled(self) -> TiledTensors:
        """The parts' tiles one after another: the same bytes as `PackedTensors.cat(parts).tiled()`."""
        from vlite import _custom_ops

        return _tile_gguf(self.parts, _custom_ops.load())


def _tile_gguf(parts: list[PackedTensors], kernels: Any) -> TiledTensors:
    """GGUF-type weights of one layout (each but the last a whole number of tiles), tiled by the kernels from the
    file's map into one huge-page buffer, part after part; each part's file pages are given back once read."""
    first = parts[0]
    n, k = sum(p.shape[0] for p in parts), first.shape[1]
    qt_shape, st_shape, st_dtype = gguf_blocks.tile_shapes(first.fmt, n, k)
    qt, st = weight_arena.empty(qt_shape, torch.uint8), weight_arena.empty(st_shape, st_dtype)
    t0 = 0
    for p in parts:
        t1 = t0 + -(-p.shape[0] // TILE)
        kernels.tile_gguf(p.qs.contiguous(), first.kernel_fmt, k, qt[t0:t1], st[t0:t1])
        weight_arena.release_file_pages(p.qs)  # read from the file's map: its pages can go
        t0 = t1
    return TiledTensors(first.kernel_fmt, qt, st, None, first.sub, n, k)


@dataclass
class TiledTensors:
    """Packed weights in the kernels' row-tiled layout (PackedTensors.tiled())."""

    fmt: int  # the kernels' layout code: 4 (q4), 8 (q8), or a GGUF type id (2 Q4_0, 12 Q4_K, ...: gguf_blocks.COMPACT)
    qt: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    sub: int
    n: int  # output rows (the tiles hold a multiple of 16)
    k: int

    def untiled(self) -> PackedTensors:
        """Back to the row-major layout (reference code and tests). Not for the GGUF types' tiles, whose
        values the kernels' `dequantize` gives (keep their PackedTensors for anything else)."""
        if self.fmt not in (4, 8):
            raise ValueError(f"tiles of layout {self.fmt} (a GGUF type) have no row-major form here: dequantize them "
                             "with the kernels, or keep the PackedTensors")
        tiles, nb = self.qt.shape[0], self.k // QK
        chunks = 4 if self.fmt == 4 else 8
        qs = self.qt.view(tiles, nb, chunks, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, -1)[:self.n]
        if self.fmt == 8:
            qs = (qs ^ 0x80).view(torch.int8)

        def by_row(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(tiles * TILE, -1)[:self.n].contiguous()

        return PackedTensors("q4" if self.fmt == 4 else "q8", qs.contiguous(), by_row(self.scales),
                             None if self.mins is None else by_row(self.mins), self.sub)

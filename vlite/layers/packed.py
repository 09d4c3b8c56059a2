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

The kernels read a row-tiled copy (`TiledTensors`, made once at load by `PackedTensors.tiled()`):
16 output rows per tile, and in each block the 4-input chunks of the 16 rows side by side, so that
one vector register holds the same inputs of many rows (see quant_linear.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from vlite.layers import weight_arena

QK = 32  # inputs per block
TILE = 16  # output rows per tile of the kernels' layout


@dataclass
class PackedTensors:
    fmt: str  # "q4" or "q8"
    qs: torch.Tensor  # q4: uint8 [N, K/2]; q8: int8 [N, K]
    scales: torch.Tensor  # float16 or float32 [N, K/sub]
    mins: Optional[torch.Tensor]  # same dtype as scales, [N, K/32], or None (zero)
    sub: int = QK  # inputs per scale: 32, or 16 (q8 only)

    @property
    def bits(self) -> int:
        """The C++ kernels' name for the layout: 4 (q4) or 8 (q8)."""
        return 4 if self.fmt == "q4" else 8

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        return n, self.qs.shape[1] * (2 if self.fmt == "q4" else 1)

    def rows(self, index: torch.Tensor) -> PackedTensors:
        """The same weight with its rows reordered (GGUF's Q/K rotary permutation, fused QKV)."""
        return PackedTensors(self.fmt, self.qs[index], self.scales[index],
                             None if self.mins is None else self.mins[index], self.sub)

    def cols(self, start: int, end: int) -> PackedTensors:
        """Inputs [start, end) of every row (a row-parallel shard): whole blocks of 32 only, so every
        value and scale is kept as is."""
        n, k = self.shape
        if start % QK or end % QK or not 0 <= start < end <= k:
            raise ValueError(f"packed columns [{start}, {end}) of a [{n}, {k}] weight must split at "
                             f"multiples of the block size {QK}")
        per = 2 if self.fmt == "q4" else 1
        return PackedTensors(self.fmt, self.qs[:, start // per:end // per].contiguous(),
                             self.scales[:, start // self.sub:end // self.sub].contiguous(),
                             None if self.mins is None else self.mins[:, start // QK:end // QK].contiguous(), self.sub)

    @staticmethod
    def cat(parts: list[PackedTensors]) -> PackedTensors:
        """Stack along rows (fused QKV / gate-up); all parts must share one layout."""
        first = parts[0]
        if any((p.fmt, p.sub, p.scales.dtype, p.mins is None) != (first.fmt, first.sub, first.scales.dtype,
                                                                      first.mins is None) for p in parts):
            raise ValueError("cannot fuse packed weights of different layouts")
        return PackedTensors(first.fmt, torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]),
                             None if first.mins is None else torch.cat([p.mins for p in parts]), first.sub)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight these values stand for (reference code: plain torch, float32 math)."""
        n, k = self.shape
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
        return TiledTensors(self.bits, weight_arena.place(qt), weight_arena.place(by_tile(self.scales)), mins,
                            self.sub, n, k)


@dataclass
class TiledTensors:
    """Packed weights in the kernels' row-tiled layout (PackedTensors.tiled())."""

    bits: int  # 4 (q4) or 8 (q8)
    qt: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    sub: int
    n: int  # output rows (the tiles hold a multiple of 16)
    k: int

    def untiled(self) -> PackedTensors:
        """Back to the row-major layout (reference code and tests)."""
        tiles, nb = self.qt.shape[0], self.k // QK
        chunks = 4 if self.bits == 4 else 8
        qs = self.qt.view(tiles, nb, chunks, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, -1)[:self.n]
        if self.bits == 8:
            qs = (qs ^ 0x80).view(torch.int8)

        def by_row(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(tiles * TILE, -1)[:self.n].contiguous()

        return PackedTensors("q4" if self.bits == 4 else "q8", qs.contiguous(), by_row(self.scales),
                             None if self.mins is None else by_row(self.mins), self.sub)

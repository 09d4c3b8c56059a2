// GGUF Q4_0 / Q4_K / Q5_K / Q6_K (and gguf_kinds.h's Q2_K / Q3_K / IQ4_NL / IQ4_XS / MXFP4) rows -> the kernels'
// file-sized tiles (compact_blocks.h), in C++ at load: the same bytes vlite/layers/gguf_blocks.py's `tile` (the
// reference, in numpy) makes, ~50x faster, read
// straight from the file's memory map and written into the caller's (huge-page) buffers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "compact_blocks.h"

namespace vlite {

namespace {
constexpr int64_t kRowsPerTile = 16;

// Q4_K/Q5_K: 12 bytes of packed 6-bit sub-scales and sub-mins -> sc[8], mn[8]
inline void k_scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

inline void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline void put_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
inline uint16_t get_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t get_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
constexpr uint32_t kLo = 0x0F0F0F0Fu;

// Byte i of the result: bits `shift`.. (`mask` in each byte) of src[4p + i], placed at bit width * p, p < n:
// one 32-value block's high bits of four rows' inputs as the tile's high plane packs them (four bytes at once).
inline uint32_t gather_bits(const uint8_t* src, int n, int shift, uint32_t mask, int width) {
  uint32_t bits = 0;
  for (int p = 0; p < n; ++p) bits |= (get_u32(src + 4 * p) >> shift & mask) << (width * p);
  return bits;
}

// The nibbles of one 32-value block of one row into the tile, four bytes (one chunk p) at a time:
// tile byte (chunk p, input i) = value 4p + i | value 16 + 4p + i << 4. The values are the nibbles at
// `shift` (0 or 4) of src[0..31] (Q4_0: src[j] & 15 is value j, src[j] >> 4 value j + 16).
inline void put_nibbles(const uint8_t* src, int shift, uint8_t* nib) {
  for (int p = 0; p < 4; ++p) {
    const uint32_t lo = get_u32(src + 4 * p), hi = get_u32(src + 16 + 4 * p);
    put_u32(nib + 64 * p, shift == 0 ? (lo & kLo) | (hi & kLo) << 4 : (lo >> 4 & kLo) | (hi & ~kLo));
  }
}

// tile_row_block for gguf_kinds.h's types (their layouts there)
void tile_lowbit_block(int64_t code, const uint8_t* blk, uint8_t* q, uint8_t* hb, uint8_t* st, int64_t l) {
  if (code == kIQ4_NL || code == kMXFP4) {  // (d f16 | e u8), qs[16] in Q4_0's order: the tile's bytes
    const uint8_t* qs = blk + (code == kIQ4_NL ? 2 : 1);
    if (code == kIQ4_NL) put_u16(st + 2 * l, get_u16(blk));
    else st[l] = blk[0];
    for (int p = 0; p < 4; ++p) std::memcpy(q + 64 * p, qs + 4 * p, 4);
    return;
  }
  if (code == kIQ4_XS) {  // d, scales_h u16, scales_l[4], qs[128]: sub-block b's 16 bytes in Q4_0's order
    for (int b = 0; b < 8; ++b)
      for (int p = 0; p < 4; ++p) std::memcpy(q + 256 * b + 64 * p, blk + 8 + 16 * b + 4 * p, 4);
    put_u16(st + 2 * l, get_u16(blk));
    put_u32(st + 32 + 4 * l, get_u32(blk + 4));
    put_u16(st + 96 + 2 * l, get_u16(blk + 2));
    return;
  }
  // Q2_K: scales[16], qs[64], d, dmin; Q3_K: hmask[32], qs[64], scales[12], d. Value 128h + 32s + i's low 2 bits
  // at bits 2s of qs[32h + i]: block b = 4h + s; Q3_K's bit 2 of value 32b + i: bit b of hmask[i] (set: u += 4)
  const uint8_t* qs = blk + (code == kQ2_K ? 16 : 32);
  for (int b = 0; b < 8; ++b) {
    const uint8_t* g = qs + 32 * (b / 4);
    for (int h = 0; h < 2; ++h)  // plane h, byte i, bits 2s: input 4(4h + s) + i
      put_u32(q + 128 * b + 64 * h, gather_bits(g + 16 * h, 4, 2 * (b % 4), 0x03030303u, 2));
    if (code == kQ3_K) put_u32(hb + 64 * b, gather_bits(blk, 8, b, 0x01010101u, 1));
  }
  put_u16(st + 2 * l, get_u16(blk + (code == kQ2_K ? 80 : 108)));
  if (code == kQ2_K) {
    put_u16(st + 32 + 2 * l, get_u16(blk + 82));
    for (int i = 0; i < 16; ++i) st[64 + i * kRowsPerTile + l] = blk[i];
    return;
  }
  const uint8_t* s = blk + 96;  // 16 6-bit scales: low 4 bits in bytes 0..7 (nibble i / 8), top 2 in 8..11
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    st[32 + i * kRowsPerTile + l] = static_cast<uint8_t>(static_cast<int8_t>((lo | hi << 4) - 32));
  }
}

// One super-block (or Q4_0 block) of one row: its values' nibbles and high bits into the tile (chunk bytes
// at row l: `q` the tile's nibbles, `hb` its high plane, both at block sb's first 32-value block), and
// its scale fields into the tile's scale bytes `st` at lane l.
void tile_row_block(int64_t code, const uint8_t* blk, uint8_t* q, uint8_t* hb, uint8_t* st, int64_t l) {
  if (is_lowbit(code)) return tile_lowbit_block(code, blk, q, hb, st, l);
  if (code == kQ4_0) {  // d, qs[16]: value j low nibble of byte j, value j + 16 high: the tile's bytes as they are
    put_u16(st + 2 * l, get_u16(blk));
    for (int p = 0; p < 4; ++p) std::memcpy(q + 64 * p, blk + 2 + 4 * p, 4);
    return;
  }
  if (code == kQ6_K) {  // ql[128], qh[64], scales[16], d; block 4h + s: values 128h + 32s + i
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s) {
        const int64_t b = 4 * h + s;
        put_nibbles(ql + 64 * h + 32 * (s & 1), 4 * (s >> 1), q + 256 * b);
        for (int plane = 0; plane < 2; ++plane)  // bits 2p.. of byte i: value 16 plane + 4p + i's bits 4-5
          put_u32(hb + 128 * b + 64 * plane, gather_bits(qh + 32 * h + 16 * plane, 4, 2 * s, 0x03030303u, 2));
      }
    put_u16(st + 2 * l, get_u16(blk + 208));
    for (int i = 0; i < 16; ++i) st[32 + i * kRowsPerTile + l] = blk[192 + i];
    return;
  }
  // Q4_K: d, dmin, scales[12], qs[128]; Q5_K: d, dmin, scales[12], qh[32], qs[128]. Group g of 64 values:
  // low nibbles of qs[32g..] values 64g + i, high nibbles 64g + 32 + i.
  const uint8_t* qs = blk + (code == kQ5_K ? 48 : 16);
  for (int b = 0; b < 8; ++b) {
    put_nibbles(qs + 32 * (b / 2), 4 * (b % 2), q + 256 * b);
    if (code == kQ5_K)  // bit p of byte i: bit 4 of value 4p + i, i.e. bit b of qh[4p + i]
      put_u32(hb + 64 * b, gather_bits(blk + 16, 8, b, 0x01010101u, 1));
  }
  uint8_t sc[8], mn[8];
  k_scale_min(blk + 4, sc, mn);
  uint32_t lo_sc = 0, lo_mn = 0, hi = 0;
  for (int j = 0; j < 8; ++j) {
    lo_sc |= static_cast<uint32_t>(sc[j] & 15) << (4 * j);
    lo_mn |= static_cast<uint32_t>(mn[j] & 15) << (4 * j);
    hi |= static_cast<uint32_t>(sc[j] >> 4) << (2 * j) | static_cast<uint32_t>(mn[j] >> 4) << (16 + 2 * j);
  }
  put_u16(st + 2 * l, get_u16(blk));
  put_u16(st + 32 + 2 * l, get_u16(blk + 2));
  put_u32(st + 64 + 4 * l, lo_sc);
  put_u32(st + 128 + 4 * l, lo_mn);
  put_u32(st + 192 + 4 * l, hi);
}
}  // namespace

// raw uint8 [N, row bytes] (the file's blocks) -> qt uint8 [tiles, K/32 * (256 + 64 * high bits)] and st
// (Q4_0 float16 [tiles, K/32, 16]; K-quants uint8 [tiles, K/256, 256 or 288]), both preallocated
void tile_gguf(at::Tensor raw, int64_t code, int64_t K, at::Tensor qt, at::Tensor st) {
  TORCH_CHECK(is_compact(code), "tile_gguf: GGUF type code must be 2, 10, 11, 12, 13, 14, 20, 23 or 39, got ", code);
  const int64_t block = compact_block(code);
  const int64_t bytes = code == kQ4_0 ? 18 : code == kQ4_K ? 144 : code == kQ5_K ? 176 : code == kQ6_K ? 210
                        : code == kQ2_K ? 84 : code == kQ3_K ? 110 : code == kIQ4_NL ? 18 : code == kIQ4_XS ? 136 : 17;
  TORCH_CHECK(K % block == 0, "tile_gguf: K must be a multiple of ", block);
  TORCH_CHECK(raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.dim() == 2 &&
              raw.size(1) == K / block * bytes, "tile_gguf: raw must be contiguous uint8 [N, ", K / block * bytes, "]");
  const int64_t N = raw.size(0), tiles = (N + kRowsPerTile - 1) / kRowsPerTile, nb = K / 32;
  const int64_t main_bytes = kind_block_bytes(compact_weight_kind(code));
  const int64_t high_bytes = kind_high_bytes(compact_weight_kind(code));
  const int64_t qt_cols = nb * (main_bytes + high_bytes);
  const int64_t st_block = compact_superblock_bytes(code);  // per block / super-block
  TORCH_CHECK(qt.is_contiguous() && qt.scalar_type() == at::kByte && qt.numel() == tiles * qt_cols,
              "tile_gguf: qt must be contiguous uint8 with ", tiles * qt_cols, " bytes");
  TORCH_CHECK(st.is_contiguous() && st.numel() * st.element_size() == tiles * (K / block) * st_block,
              "tile_gguf: st must be contiguous with ", tiles * (K / block) * st_block, " bytes");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* qd = qt.data_ptr<uint8_t>();
  uint8_t* sd = reinterpret_cast<uint8_t*>(st.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* q = qd + t * qt_cols;
      uint8_t* s = sd + t * (K / block) * st_block;
      const int64_t rows = std::min(kRowsPerTile, N - t * kRowsPerTile);
      if (rows < kRowsPerTile) {  // the lanes of padding rows are zeros (every byte of a full tile is written)
        std::memset(q, 0, qt_cols);
        std::memset(s, 0, (K / block) * st_block);
      }
      for (int64_t l = 0; l < rows; ++l) {
        const uint8_t* row = src + (t * kRowsPerTile + l) * (K / block) * bytes;
        for (int64_t sb = 0; sb < K / block; ++sb) {
          const int64_t b = sb * (block / 32);  // its first 32-value block
          tile_row_block(code, row + sb * bytes, q + b * main_bytes + 4 * l, q + nb * main_bytes + b * high_bytes + 4 * l,
                         s + sb * st_block, l);
        }
      }
    }
  });
}

}  // namespace vlite

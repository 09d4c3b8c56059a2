// GGUF Q4_0 / Q4_K / Q5_K / Q6_K rows -> the kernels' file-sized tiles (compact_blocks.h), in C++ at load:
// the same bytes vlite/layers/gguf_blocks.py's `tile` (the reference, in numpy) makes, ~50x faster, read
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

// One super-block (or Q4_0 block) of one row: its 256 (32) values, and its scale fields into the tile's
// scale bytes `st` at lane l.
void decode_row_block(int64_t code, const uint8_t* blk, uint8_t* v, uint8_t* st, int64_t l) {
  if (code == kQ4_0) {  // d, qs[16]: value j low nibble of byte j, value j + 16 high
    put_u16(st + 2 * l, get_u16(blk));
    for (int j = 0; j < 16; ++j) {
      v[j] = blk[2 + j] & 15;
      v[j + 16] = blk[2 + j] >> 4;
    }
    return;
  }
  if (code == kQ6_K) {  // ql[128], qh[64], scales[16], d
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 64; ++i) {
        v[128 * h + i] = ql[64 * h + i] & 15;
        v[128 * h + 64 + i] = ql[64 * h + i] >> 4;
      }
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 32; ++i) v[128 * h + 32 * s + i] |= ((qh[32 * h + i] >> (2 * s)) & 3) << 4;
    put_u16(st + 2 * l, get_u16(blk + 208));
    for (int i = 0; i < 16; ++i) st[32 + i * kRowsPerTile + l] = blk[192 + i];
    return;
  }
  // Q4_K: d, dmin, scales[12], qs[128]; Q5_K: d, dmin, scales[12], qh[32], qs[128]
  const uint8_t* qs = blk + (code == kQ5_K ? 48 : 16);
  for (int g = 0; g < 4; ++g)
    for (int i = 0; i < 32; ++i) {
      v[64 * g + i] = qs[32 * g + i] & 15;
      v[64 * g + 32 + i] = qs[32 * g + i] >> 4;
    }
  if (code == kQ5_K)
    for (int b = 0; b < 8; ++b)
      for (int i = 0; i < 32; ++i) v[32 * b + i] |= ((blk[16 + i] >> b) & 1) << 4;
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
  TORCH_CHECK(is_compact(code), "tile_gguf: GGUF type code must be 2, 12, 13 or 14, got ", code);
  const int64_t block = code == kQ4_0 ? 32 : 256, bytes = code == kQ4_0 ? 18 : code == kQ4_K ? 144
                                                        : code == kQ5_K ? 176 : 210;
  TORCH_CHECK(K % block == 0, "tile_gguf: K must be a multiple of ", block);
  TORCH_CHECK(raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.dim() == 2 &&
              raw.size(1) == K / block * bytes, "tile_gguf: raw must be contiguous uint8 [N, ", K / block * bytes, "]");
  const int64_t N = raw.size(0), tiles = (N + kRowsPerTile - 1) / kRowsPerTile, nb = K / 32;
  const int64_t high_bits = compact_weight_kind(code) - 4;
  const int64_t qt_cols = nb * 256 + nb * 64 * high_bits;
  const int64_t st_block = code == kQ4_0 ? 32 : compact_superblock_bytes(code);  // per block / super-block
  TORCH_CHECK(qt.is_contiguous() && qt.scalar_type() == at::kByte && qt.numel() == tiles * qt_cols,
              "tile_gguf: qt must be contiguous uint8 with ", tiles * qt_cols, " bytes");
  TORCH_CHECK(st.is_contiguous() && st.numel() * st.element_size() == tiles * (K / block) * st_block,
              "tile_gguf: st must be contiguous with ", tiles * (K / block) * st_block, " bytes");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* qd = qt.data_ptr<uint8_t>();
  uint8_t* sd = reinterpret_cast<uint8_t*>(st.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    uint8_t v[256];
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* q = qd + t * qt_cols;
      uint8_t* s = sd + t * (K / block) * st_block;
      std::memset(q, 0, qt_cols);
      std::memset(s, 0, (K / block) * st_block);
      for (int64_t l = 0; l < kRowsPerTile && t * kRowsPerTile + l < N; ++l) {
        const uint8_t* row = src + (t * kRowsPerTile + l) * (K / block) * bytes;
        for (int64_t sb = 0; sb < K / block; ++sb) {
          decode_row_block(code, row + sb * bytes, v, s + sb * st_block, l);
          for (int64_t bb = 0; bb < block / 32; ++bb) {  // the 32-value blocks of this (super-)block
            const int64_t b = sb * (block / 32) + bb;
            const uint8_t* vb = v + 32 * bb;
            uint8_t* nib = q + b * 256 + 4 * l;  // chunk p: inputs 4p.. (low nibble), 16 + 4p.. (high)
            for (int p = 0; p < 4; ++p)
              for (int i = 0; i < 4; ++i) nib[64 * p + i] = (vb[4 * p + i] & 15) | (vb[16 + 4 * p + i] & 15) << 4;
            uint8_t* hb = q + nb * 256 + b * 64 * high_bits + 4 * l;
            if (high_bits == 1) {  // bit p of byte i: input 4p + i
              for (int i = 0; i < 4; ++i) {
                uint8_t byte = 0;
                for (int p = 0; p < 8; ++p) byte |= ((vb[4 * p + i] >> 4) & 1) << p;
                hb[i] = byte;
              }
            } else if (high_bits == 2) {  // plane h, bits 2p..: input 16h + 4p + i
              for (int h = 0; h < 2; ++h)
                for (int i = 0; i < 4; ++i) {
                  uint8_t byte = 0;
                  for (int p = 0; p < 4; ++p) byte |= ((vb[16 * h + 4 * p + i] >> 4) & 3) << (2 * p);
                  hb[64 * h + i] = byte;
                }
            }
          }
        }
      }
    }
  });
}

}  // namespace vlite

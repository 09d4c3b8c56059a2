// GGUF's Q4_0, Q4_K, Q5_K and Q6_K weights at the file's size (vlite/layers/gguf_blocks.py): the kernels
// read the 4-bit part of each weight from q4's tiles, the 1 or 2 high bits from a plane after them, and
// decode each tile's scales from the file's super-block fields into float32 once per tile and call:
//
//   Q4_0 (code 2)   scales: float16 d [tiles, K/32, 16]; scale d, min -8d
//   Q4_K (12), Q5_K (13)  uint8 [tiles, K/256, 256]: per super-block float16 d[16], dmin[16], then
//                   uint32 lo_sc[16] (nibble j: sub-scale j's low 4 bits), lo_mn[16] (the same for the
//                   sub-mins) and hi[16] (bits 2j..2j+1: sub-scale j's top 2 bits, 16 + 2j..: sub-min j's);
//                   scale d * sc_j, min -(dmin * m_j) per 32
//   Q6_K (14)       uint8 [tiles, K/256, 288]: float16 d[16], int8 sc[16 sub-blocks][16]; scale d * sc_i per 16
//   Q2_K (10), Q3_K (11), IQ4_NL (20), IQ4_XS (23), MXFP4 (39): gguf_kinds.h
//
// Lane l is row l of the tile throughout. Every product is exact in float32 (16-bit float times a
// 6- or 8-bit integer), as the converted layouts' precomputed scales were: the same sums, bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace vlite {

enum CompactCode : int64_t {
  kQ4_0 = 2, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kQ2_K = 10, kQ3_K = 11, kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39  // gguf_kinds.h
};

// the types the kernels read at the file's size (gguf_kinds.h: Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4)
inline bool is_lowbit(int64_t code) {
  return code == kQ2_K || code == kQ3_K || code == kIQ4_NL || code == kIQ4_XS || code == kMXFP4;
}
inline bool is_compact(int64_t code) {
  return code == kQ4_0 || code == kQ4_K || code == kQ5_K || code == kQ6_K || is_lowbit(code);
}

// the weight kind the tile kernels read (4: nibbles, 5/6: nibbles + high plane; gguf_kinds.h: 2, 3: a 2-bit
// plane (+ a 1-bit plane), 20/39: nibbles through IQ4_NL's or MXFP4's table)
inline int compact_weight_kind(int64_t code) {
  switch (code) {
    case kQ5_K: return 5;
    case kQ6_K: return 6;
    case kQ2_K: return 2;
    case kQ3_K: return 3;
    case kIQ4_NL: case kIQ4_XS: return 20;
    case kMXFP4: return 39;
    default: return 4;
  }
}
// bits per weight in the tiles
inline int64_t compact_weight_bits(int64_t code) {
  const int kind = compact_weight_kind(code);
  return kind == 2 || kind == 3 || kind == 5 || kind == 6 ? kind : 4;
}
inline int64_t compact_sub(int64_t code) { return code == kQ6_K || code == kQ2_K || code == kQ3_K ? 16 : 32; }
inline bool compact_has_mins(int64_t code) { return code == kQ4_0 || code == kQ4_K || code == kQ5_K || code == kQ2_K; }
// inputs per min: Q2_K has one per 16-input sub-block, the others one per 32
inline int64_t compact_min_sub(int64_t code) { return code == kQ2_K ? 16 : 32; }
// values per block of the file
inline int64_t compact_block(int64_t code) { return code == kQ4_0 || code == kIQ4_NL || code == kMXFP4 ? 32 : 256; }
// bytes of one super-block's scales of one tile (256-value types), or of one block's (the 32-value ones)
constexpr int64_t compact_superblock_bytes(int64_t code) {
  return code == kQ6_K || code == kQ3_K ? 288 : code == kQ2_K ? 320 : code == kIQ4_XS ? 128
         : code == kQ4_0 || code == kIQ4_NL ? 32 : code == kMXFP4 ? 16 : 256;
}

inline void halves_to_float(const c10::Half* p, float* out, int64_t n) {
#if defined(VLITE_X86)
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#else
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
#endif
}

}  // namespace vlite

#include "gguf_kinds.h"

namespace vlite {

// Blocks [b0, b1) of one tile's scales (sc [(b1 - b0) * 32 / sub][16]) and mins (mn [b1 - b0][16], where
// the type has them) in float32; K-quants: b0, b1 multiples of 8 (whole super-blocks). `st`: the tile's
// scale bytes; lanes: the tile's rows. The AVX2 kernels decode two super-blocks at a time into a buffer
// that stays in L1 (a whole tile's at once, 2 x 16 KB for K = 8192, did not: one row, one thread, a Q4_K
// 8192 x 2048 hot in L3 560 -> 410 us; with the loops below in intrinsics rather than left to the compiler).
inline void decode_scales(int64_t code, const uint8_t* st, int64_t b0, int64_t b1, float* sc, float* mn) {
  constexpr int64_t L = 16;
  if (is_lowbit(code)) return decode_lowbit_scales(code, st, b0, b1, sc, mn);
  if (code == kQ4_0) {
    halves_to_float(reinterpret_cast<const c10::Half*>(st) + b0 * L, sc, (b1 - b0) * L);
    for (int64_t i = 0; i < (b1 - b0) * L; ++i) mn[i] = sc[i] * -8.f;
    return;
  }
  const int64_t bytes = compact_superblock_bytes(code);
  for (int64_t s = b0 / 8; s < b1 / 8; ++s, sc += (code == kQ6_K ? 16 : 8) * L, mn += 8 * L) {
    const uint8_t* p = st + s * bytes;
    alignas(64) float d[L];
    halves_to_float(reinterpret_cast<const c10::Half*>(p), d, L);
    if (code == kQ6_K) {
      const int8_t* q = reinterpret_cast<const int8_t*>(p + 2 * L);
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t l = 0; l < L; ++l) sc[i * L + l] = d[l] * static_cast<float>(q[i * L + l]);
      continue;
    }
    alignas(64) float dmin[L];
    halves_to_float(reinterpret_cast<const c10::Half*>(p + 2 * L), dmin, L);
#if defined(VLITE_X86)
    const __m256i m4 = _mm256_set1_epi32(15), m2 = _mm256_set1_epi32(3);
    for (int64_t h = 0; h < L; h += 8) {
      const __m256i lo_sc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4 * L) + h / 8);
      const __m256i lo_mn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * L) + h / 8);
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 12 * L) + h / 8);
      const __m256 dv = _mm256_load_ps(d + h), mv = _mm256_load_ps(dmin + h);
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lo_sc, 4 * j), m4),
                                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2 * j), m2), 4));
        const __m256i m = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lo_mn, 4 * j), m4),
                                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 16 + 2 * j), m2), 4));
        _mm256_storeu_ps(sc + j * L + h, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(v)));
        _mm256_storeu_ps(mn + j * L + h, _mm256_xor_ps(_mm256_mul_ps(mv, _mm256_cvtepi32_ps(m)), _mm256_set1_ps(-0.f)));
      }
    }
#else
    alignas(64) uint32_t lo_sc[L], lo_mn[L], hi[L];
    std::memcpy(lo_sc, p + 4 * L, sizeof(lo_sc));
    std::memcpy(lo_mn, p + 8 * L, sizeof(lo_mn));
    std::memcpy(hi, p + 12 * L, sizeof(hi));
    for (int j = 0; j < 8; ++j)
      for (int64_t l = 0; l < L; ++l) {
        const uint32_t v = ((lo_sc[l] >> (4 * j)) & 15u) | (((hi[l] >> (2 * j)) & 3u) << 4);
        const uint32_t m = ((lo_mn[l] >> (4 * j)) & 15u) | (((hi[l] >> (16 + 2 * j)) & 3u) << 4);
        sc[j * L + l] = d[l] * static_cast<float>(static_cast<int32_t>(v));
        mn[j * L + l] = -(dmin[l] * static_cast<float>(static_cast<int32_t>(m)));
      }
#endif
  }
}

// One tile's scales (sc [K/sub][16]) and mins (mn [K/32][16]; Q2_K [K/16][16]) in float32: decode_scales of every block
inline void decode_tile_scales(int64_t code, const uint8_t* st, int64_t K, float* sc, float* mn) {
  decode_scales(code, st, 0, K / 32, sc, mn);
}

}  // namespace vlite

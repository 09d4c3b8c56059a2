// GGUF's Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 at the file's size (vlite/layers/gguf_low_bits.py, the numpy
// reference of these tiles): their weight kinds and scale bytes, and how each ISA build turns one 32-input block
// of a tile (16 rows) into the integers the kernels of quant_linear.cpp multiply.
//
// Weight kinds (the kernels' FMT; the 32-input block of a tile, 16 rows, row l at bytes 4l..4l+3 of each vector):
//   2  (Q2_K)   a 2-bit plane: two 64-byte vectors P0, P1; byte 4l + i of P_h holds input 4(4h + s) + i at bits
//               2s..2s+1 (s 0..3): u 0..3                                        w = scale * u + min (both per 16)
//   3  (Q3_K)   the same 2-bit plane, and after the tile's blocks a 1-bit plane laid out as Q5_K's (byte 4l + i,
//               bit j: input 4j + i's bit 2): u 0..7                              w = scale * (u - 4)
//   20 (IQ4_NL, IQ4_XS)  q4's nibble tiles; a nibble picks kValuesIQ4NL[nibble]   w = scale * value
//   39 (MXFP4)  the same nibbles through kValuesFP4 (E2M1 values, doubled)        w = scale * value
// Scale bytes (st), per tile:
//   Q2_K   uint8 [K/256, 320]: float16 d[16], dmin[16], then the file's scale bytes [16 sub-blocks][16 lanes]
//          (low nibble: sub-scale, high: sub-min): scale d * sc, min -(dmin * m) per 16 inputs
//   Q3_K   uint8 [K/256, 288]: float16 d[16], int8 sc - 32 [16 sub-blocks][16 lanes] (Q6_K's layout; the file
//          packs the 6-bit sub-scales in 12 bytes a row, these 16): scale d * (sc - 32) per 16
//   IQ4_NL float16 d [K/32, 16]: scale d
//   IQ4_XS uint8 [K/256, 128]: float16 d[16], uint32 lo[16] (the file's scales_l: nibble j = sub-scale j's low 4
//          bits), uint16 hi[16] (its scales_h: bits 2j, 2j+1 = the top 2): scale d * (ls - 32) per 32
//   MXFP4  uint8 e [K/32, 16] (E8M0): scale 2^(e - 128) (the table is doubled)
// Every scale is exact in float32 (a 16-bit float times a 6-bit integer, or a power of two), and so is every value
// times it: the kernels sum the very values gguf.quants' dequantizers give.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace vlite {

alignas(16) inline constexpr int8_t kValuesIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                         1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) inline constexpr int8_t kValuesFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

constexpr bool is_lowbit_kind(int kind) { return kind == 2 || kind == 3 || kind == 20 || kind == 39; }
// bytes of one 32-input block of a tile (16 rows): its low bits (q8: the bytes), and its share of the high plane
constexpr int64_t kind_block_bytes(int kind) { return kind == 8 ? 512 : kind == 2 || kind == 3 ? 128 : 256; }
constexpr int64_t kind_high_bytes(int kind) { return kind == 5 || kind == 3 ? 64 : kind == 6 ? 128 : 0; }

// E8M0 -> float32, halved (ggml's convention for MXFP4's doubled table): 2^(e - 128), e < 2 as denormals
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// decode_scales (compact_blocks.h) for these types: blocks [b0, b1) of one tile's scale bytes -> sc
// [(b1 - b0) * 32 / sub][16], Q2_K's mins mn [(b1 - b0) * 2][16]; 256-value types: b0, b1 multiples of 8
inline void decode_lowbit_scales(int64_t code, const uint8_t* st, int64_t b0, int64_t b1, float* sc, float* mn) {
  constexpr int64_t L = 16;
  if (code == 20) {  // IQ4_NL
    halves_to_float(reinterpret_cast<const c10::Half*>(st) + b0 * L, sc, (b1 - b0) * L);
    return;
  }
  if (code == 39) {  // MXFP4
    for (int64_t i = 0; i < (b1 - b0) * L; ++i) sc[i] = e8m0_half(st[b0 * L + i]);
    return;
  }
  const int64_t bytes = code == 10 ? 320 : code == 11 ? 288 : 128;
  for (int64_t s = b0 / 8; s < b1 / 8; ++s) {
    const uint8_t* p = st + s * bytes;
    alignas(64) float d[L];
    halves_to_float(reinterpret_cast<const c10::Half*>(p), d, L);
    if (code == 11) {  // Q3_K
      const int8_t* q = reinterpret_cast<const int8_t*>(p + 2 * L);
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t l = 0; l < L; ++l) sc[i * L + l] = d[l] * static_cast<float>(q[i * L + l]);
      sc += 16 * L;
    } else if (code == 10) {  // Q2_K
      alignas(64) float dmin[L];
      halves_to_float(reinterpret_cast<const c10::Half*>(p + 2 * L), dmin, L);
      const uint8_t* q = p + 4 * L;
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t l = 0; l < L; ++l) {
          sc[i * L + l] = d[l] * static_cast<float>(q[i * L + l] & 15);
          mn[i * L + l] = -(dmin[l] * static_cast<float>(q[i * L + l] >> 4));
        }
      sc += 16 * L;
      mn += 16 * L;
    } else {  // IQ4_XS
      alignas(64) uint32_t lo[L];
      alignas(64) uint16_t hi[L];
      std::memcpy(lo, p + 2 * L, sizeof(lo));
      std::memcpy(hi, p + 6 * L, sizeof(hi));
      for (int j = 0; j < 8; ++j)
        for (int64_t l = 0; l < L; ++l) {
          const int ls = static_cast<int>(((lo[l] >> (4 * j)) & 15u) | (((hi[l] >> (2 * j)) & 3u) << 4));
          sc[j * L + l] = d[l] * static_cast<float>(ls - 32);
        }
      sc += 8 * L;
    }
  }
}

// Row l's 32 weight integers of block b of a tile (signed: Q3_K's u - 4, the tables' values), natural input order:
// reference code (portable kernels, dequantize)
template <int KIND, typename V>
inline void lowbit_block_values(const uint8_t* qt, int64_t nb, int64_t b, int64_t l, V* out) {
  const uint8_t* wb = qt + b * kind_block_bytes(KIND) + 4 * l;
  const uint8_t* hb = qt + nb * kind_block_bytes(KIND) + b * kind_high_bytes(KIND) + 4 * l;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      int v;
      if constexpr (KIND == 2 || KIND == 3) {
        v = (wb[64 * (j / 4) + i] >> (2 * (j % 4))) & 3;
        if constexpr (KIND == 3) v += (((hb[i] >> j) & 1) << 2) - 4;
      } else {  // chunk j % 4: inputs 4j.. in the low nibbles (j < 4), in the high ones (j >= 4)
        const uint8_t byte = wb[64 * (j % 4) + i];
        v = (KIND == 20 ? kValuesIQ4NL : kValuesFP4)[j < 4 ? (byte & 0x0F) : (byte >> 4)];
      }
      out[4 * j + i] = static_cast<V>(v);
    }
}

#if defined(VLITE_AVX2)
// AVX2: rows 8h..8h+7 (h in [h0, h1)) of one block as q8's tile block (w + 128 as u8, chunk j at 64j + 32h),
// for q8_block_ints: the tables' nibbles through one `vpshufb` each
template <int KIND>
inline void lowbit_block_to_q8(const uint8_t* wb, const uint8_t* hb, uint8_t* out, int h0, int h1) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int h = h0; h < h1; ++h) {
    if constexpr (KIND == 2 || KIND == 3) {
      const __m256i m3 = _mm256_set1_epi8(3);
      __m256i hv = _mm256_setzero_si256();
      if constexpr (KIND == 3) hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + 32 * h));
      for (int half = 0; half < 2; ++half) {
        const __m256i pv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * half + 32 * h));
        for (int s = 0; s < 4; ++s) {
          const int j = 4 * half + s;
          __m256i v = _mm256_and_si256(_mm256_srli_epi16(pv, 2 * s), m3);
          if constexpr (KIND == 3) {  // bit j -> bit 2, then u - 4 + 128
            const __m256i hi = j <= 2 ? _mm256_slli_epi16(hv, 2 - j) : _mm256_srli_epi16(hv, j - 2);
            v = _mm256_add_epi8(_mm256_or_si256(v, _mm256_and_si256(hi, _mm256_set1_epi8(4))), _mm256_set1_epi8(124));
          } else {
            v = _mm256_or_si256(v, flip);
          }
          _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * j + 32 * h), v);
        }
      }
    } else {
      const __m256i tbl = _mm256_broadcastsi128_si256(
          _mm_load_si128(reinterpret_cast<const __m128i*>(KIND == 20 ? kValuesIQ4NL : kValuesFP4)));
      const __m256i m4 = _mm256_set1_epi8(0x0F);
      for (int p = 0; p < 4; ++p) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p + 32 * h));
        const __m256i lo = _mm256_shuffle_epi8(tbl, _mm256_and_si256(raw, m4));
        const __m256i hi = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * p + 32 * h), _mm256_xor_si256(lo, flip));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * (4 + p) + 32 * h), _mm256_xor_si256(hi, flip));
      }
    }
  }
}

// AVX2, Q2_K and Q3_K: one block's integer dot products for the whole tile and R activation rows, out[h][p][r]
// (h: the half of 8 weight rows, p: the 16-input sub-block), as q8_block_ints gives them (the same integers): their
// u <= 7 multiply the activations straight (`vpmaddubsw`: four chunks' pair sums <= 7112 fit an int16), without the
// sign trick and the q8 buffer, and Q3_K's 4 sum(x) is subtracted from the sums.
template <int KIND, int R, typename A>
inline void lowbit_u_block_ints(const uint8_t* wb, const uint8_t* hb, const A& a, int64_t m0, int64_t b,
                                int32_t (*out)[2][R][8]) {
  const __m256i m3 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  for (int pass = 0; pass < 2; ++pass) {  // sub-block `pass`: chunks 4 pass + s, plane `pass`
    __m256i w[4][2];
    for (int h = 0; h < 2; ++h) {
      const __m256i pv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * pass + 32 * h));
      __m256i hv = _mm256_setzero_si256();
      if constexpr (KIND == 3) hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + 32 * h));
      for (int s = 0; s < 4; ++s) {
        w[s][h] = _mm256_and_si256(_mm256_srli_epi16(pv, 2 * s), m3);
        if constexpr (KIND == 3) {
          const int j = 4 * pass + s;
          const __m256i hi = j <= 2 ? _mm256_slli_epi16(hv, 2 - j) : _mm256_srli_epi16(hv, j - 2);
          w[s][h] = _mm256_or_si256(w[s][h], _mm256_and_si256(hi, _mm256_set1_epi8(4)));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int32_t* xi = reinterpret_cast<const int32_t*>(a.q + (m0 + r) * a.K + b * 32) + 4 * pass;
      __m256i x = _mm256_set1_epi32(xi[0]);
      __m256i s0 = _mm256_maddubs_epi16(w[0][0], x), s1 = _mm256_maddubs_epi16(w[0][1], x);
      for (int s = 1; s < 4; ++s) {
        x = _mm256_set1_epi32(xi[s]);
        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[s][0], x));
        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[s][1], x));
      }
      __m256i v0 = _mm256_madd_epi16(s0, ones), v1 = _mm256_madd_epi16(s1, ones);
      if constexpr (KIND == 3) {
        const __m256i off = _mm256_set1_epi32(4 * a.isum[(m0 + r) * 2 * a.nb + 2 * b + pass]);
        v0 = _mm256_sub_epi32(v0, off);
        v1 = _mm256_sub_epi32(v1, off);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(out[0][pass][r]), v0);
      _mm256_store_si256(reinterpret_cast<__m256i*>(out[1][pass][r]), v1);
    }
  }
}
#endif

#if defined(VLITE_AVX512)
// AVX-512: one block's eight chunk vectors w[j] (inputs 4j..4j+3 of the 16 rows) as the integer products take
// them: Q2_K u, Q3_K u (the kernel subtracts 4 sum(x)), the tables' values + 128 (it subtracts 128 sum(x))
template <int KIND>
inline void lowbit_unpack512(const uint8_t* wb, const uint8_t* hb, __m512i* w) {
  if constexpr (KIND == 2 || KIND == 3) {
    const __m512i m3 = _mm512_set1_epi8(3);
    for (int half = 0; half < 2; ++half) {
      const __m512i pv = _mm512_loadu_si512(wb + 64 * half);
      for (int s = 0; s < 4; ++s) w[4 * half + s] = _mm512_and_si512(_mm512_srli_epi16(pv, 2 * s), m3);
    }
    if constexpr (KIND == 3) {
      const __m512i h = _mm512_loadu_si512(hb), bit2 = _mm512_set1_epi8(4);
      for (int j = 0; j < 8; ++j) {
        const __m512i sh = j <= 2 ? _mm512_slli_epi16(h, 2 - j) : _mm512_srli_epi16(h, j - 2);
        w[j] = _mm512_ternarylogic_epi32(w[j], sh, bit2, 0xF8);  // a | (b & c)
      }
    }
  } else {
    const __m512i tbl = _mm512_broadcast_i32x4(
        _mm_load_si128(reinterpret_cast<const __m128i*>(KIND == 20 ? kValuesIQ4NL : kValuesFP4)));
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int p = 0; p < 4; ++p) {
      const __m512i raw = _mm512_loadu_si512(wb + 64 * p);
      w[p] = _mm512_xor_si512(_mm512_shuffle_epi8(tbl, _mm512_and_si512(raw, m4)), flip);
      w[p + 4] = _mm512_xor_si512(_mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4)), flip);
    }
  }
}
#endif

}  // namespace vlite

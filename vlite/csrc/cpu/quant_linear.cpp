// Linear layers over block-quantized weights, the way llama.cpp computes them: activations are
// quantized on the fly to int8 in blocks of 32 (one float scale per block), each block's product is
// an integer dot product, and the block scales (and mins) are applied in float32:
//
//   y[m, n] = sum_b  sw[n, b] * dx[m, b] * (qw[n, b] . qx[m, b])  +  mw[n, b] * dx[m, b] * sum(qx[m, b])
//
// Weights are read in the row-tiled layout of vlite/layers/packed.py (`TiledTensors`): 16 output
// rows per tile, and within each block of 32 inputs, 4-input chunks of all 16 rows side by side.
// One vector register then holds the same 4 inputs of 16 (AVX-512) or 8 (AVX2) rows, a broadcast of
// 4 activation bytes multiplies it (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`), and every lane
// accumulates its own row: no horizontal sums, and the scales of a block are one vector load. A
// tile's weights are unpacked once per block for up to kRows activation rows.
//
// q4 tiles hold the nibbles as GGUF does (low: inputs 0..15, high: 16..31), q8 tiles hold w + 128 as
// uint8 (VNNI multiplies u8 weights by s8 activations and subtracts 128 * sum(qx); the AVX2 build
// recovers the signed value and uses the sign trick so the int16 pair sums never saturate).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "compact_blocks.h"
#include "ops.h"
#include "vec.h"

namespace vlite {

namespace {
constexpr int64_t QK = 32;
constexpr int64_t kTile = 16;  // output rows per tile
#if defined(VLITE_AVX2)
constexpr int kRows = 8;  // activation rows per weight-block unpack (AVX2: see its tile_dot)
#else
// activation rows per weight-block unpack: 8 (was 4) for speculative verify steps of 5-9 tokens, whose
// rows then share one unpack (121 linears of SmolLM2-135M: 5 rows 3.23 -> 2.95 ms, 8 rows 4.46 -> 4.0)
constexpr int kRows = 8;
#endif
#if defined(VLITE_AVX512)
constexpr bool kIsAvx512 = true;
#else
constexpr bool kIsAvx512 = false;
#endif
constexpr int64_t kActivationBlockBytes = 64 * 1024;  // int8 activation rows per pass over the tiles
// Float32 activations get the residual row in steps of at most this many rows (a few decodes, bound
// by reading the weights: the extra products are nearly free); longer steps (prefill chunks, large
// decode batches) are bound by the integer arithmetic, which the residual doubles: there a single
// int8 row measured 98.4% top-1 agreement with float32 against 100% (AVX2 path), for 0.6x the time
// to first token and 1.17x the wl32 throughput (docs/perf-log.md).
// A call may name the row count the rule goes by instead of its own (`precise_rows`): a speculative
// verify step's rows less its drafts, so that a request's rows get the residual exactly when they
// would without speculation.
constexpr int64_t kPreciseMaxRows = 8;

// ---- activations: x [M, K] -> int8 blocks of 32 with scale d = max|x| / 127 ----
// With a residual row (float32 activations: `precise`), x ~= d * (q + q_res / 256): the rounding
// error of the first int8 value, itself rounded to int8 at 1/256 of the step. The kernels treat
// it as one more activation row against the same unpacked weights (one extra integer dot product
// per block, no extra weight traffic), so products are ~16-bit accurate.
struct Activations {
  const int8_t* q;      // [R, K]
  const float* d;       // [R, nb] block scales
  const float* dsum;    // [R, nb] d * sum(q): the mins term
  const int32_t* isum;  // [R, 2 * nb] sum(q) of each 16-input half: the q8 offset correction
  int64_t K, nb;
  // AVX2, q8 weights, float32 activations: each (value, residual) pair as one int16 row,
  // x ~= (d / 256) * (256 q + q_res) (see tile_dot_i16)
  const int16_t* q16 = nullptr;  // [M, K]
  const float* d16 = nullptr;     // [M, nb]
  const float* dsum16 = nullptr;  // [M, nb]
};

#if defined(VLITE_X86)
// 32 values -> int8 (in order) and the sums of each half
static inline void pack_block(__m256 t0, __m256 t1, __m256 t2, __m256 t3, int8_t* out, int32_t* half_sums) {
  __m256i i0 = _mm256_cvtps_epi32(t0), i1 = _mm256_cvtps_epi32(t1), i2 = _mm256_cvtps_epi32(t2),
          i3 = _mm256_cvtps_epi32(t3);
  __m256i s01 = _mm256_add_epi32(i0, i1), s23 = _mm256_add_epi32(i2, i3);
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(s01), _mm256_extracti128_si256(s01, 1));
  __m128i b = _mm_add_epi32(_mm256_castsi256_si128(s23), _mm256_extracti128_si256(s23, 1));
  __m128i ab = _mm_hadd_epi32(a, b);  // a0+a1 a2+a3 b0+b1 b2+b3
  ab = _mm_hadd_epi32(ab, ab);
  half_sums[0] = _mm_cvtsi128_si32(ab);
  half_sums[1] = _mm_extract_epi32(ab, 1);
  // packs work within 128-bit lanes; a permute restores the order
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), p);
}
#endif

template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* dsum, int32_t* isum, int8_t* qr, float* dr,
                  float* dsumr, int32_t* isumr) {
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < nb; ++b) {
    const T* xb = x + b * QK;
    float xf_buf[QK];
    const float* xf = reinterpret_cast<const float*>(xb);
    if constexpr (!std::is_same_v<T, float>) {
      Vec16::load(xb).store(xf_buf);
      Vec16::load(xb + 16).store(xf_buf + 16);
      xf = xf_buf;
    }
    int32_t* hs = isum + 2 * b;
#if defined(VLITE_X86)
    __m256 xv[4];
    __m256 mx = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int j = 0; j < 4; ++j) {
      xv[j] = _mm256_loadu_ps(xf + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_and_ps(xv[j], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.f;
    const float id = db > 0.f ? 127.f / amax : 0.f;
    const __m256 idv = _mm256_set1_ps(id);
    const int rm = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256 t[4], rt[4];
    for (int j = 0; j < 4; ++j) {
      t[j] = _mm256_mul_ps(xv[j], idv);
      rt[j] = _mm256_round_ps(t[j], rm);
    }
    pack_block(rt[0], rt[1], rt[2], rt[3], q + b * QK, hs);
    if (qr != nullptr) {
      const __m256 k256 = _mm256_set1_ps(256.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
      __m256 e[4];
      for (int j = 0; j < 4; ++j)
        e[j] = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t[j], rt[j]), k256), rm)));
      pack_block(e[0], e[1], e[2], e[3], qr + b * QK, isumr + 2 * b);
    }
#else
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xf[i]));
    const float db = amax / 127.f;
    const float id = db > 0.f ? 127.f / amax : 0.f;
    hs[0] = hs[1] = 0;
    if (qr != nullptr) isumr[2 * b] = isumr[2 * b + 1] = 0;
    for (int i = 0; i < QK; ++i) {
      const float t = xf[i] * id;
      const float r = std::nearbyint(t);
      q[b * QK + i] = static_cast<int8_t>(r);
      hs[i / 16] += static_cast<int>(r);
      if (qr != nullptr) {
        const float e = std::min(127.f, std::max(-127.f, std::nearbyint((t - r) * 256.f)));
        qr[b * QK + i] = static_cast<int8_t>(e);
        isumr[2 * b + i / 16] += static_cast<int>(e);
      }
    }
#endif
    d[b] = db;
    dsum[b] = db * static_cast<float>(hs[0] + hs[1]);
    if (qr != nullptr) {
      dr[b] = db / 256.f;
      dsumr[b] = dr[b] * static_cast<float>(isumr[2 * b] + isumr[2 * b + 1]);
    }
  }
}

// rows of the outputs: one per row of x, or two (value, residual) with `precise`
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, bool precise, int8_t* q, float* d, float* dsum, int32_t* isum) {
  const int64_t nb = K / QK, per = precise ? 2 : 1;
  at::parallel_for(0, M, row_grain(K * per), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t o = m * per, o1 = o + 1;
      quantize_row(x + m * K, K, q + o * K, d + o * nb, dsum + o * nb, isum + o * 2 * nb,
                   precise ? q + o1 * K : nullptr, precise ? d + o1 * nb : nullptr,
                   precise ? dsum + o1 * nb : nullptr, precise ? isum + o1 * 2 * nb : nullptr);
    }
  });
}

// Weight kinds of the kernels (FMT): 4: q4 nibbles; 5, 6: nibbles plus a plane of 1 or 2 high bits per
// weight (Q5_K, Q6_K; compact_blocks.h); 8: q8 bytes holding w + 128; 2, 3, 20, 39: Q2_K, Q3_K, the IQ4 and
// MXFP4 tables (gguf_kinds.h).
// Bytes of one block of one tile: 16 rows x 16 (nibbles) or 32 (q8) bytes, 8 (2-bit planes); the high plane's block.
template <int FMT>
constexpr int64_t tile_block_bytes() { return kind_block_bytes(FMT); }
template <int FMT>
constexpr int64_t high_block_bytes() { return kind_high_bytes(FMT); }
// what the unsigned bytes the integer products see carry on top of the weight (q8 and the tables: +128, Q6_K:
// q - 32 -> q, Q3_K: u - 4 -> u)
template <int FMT>
constexpr int weight_offset() { return FMT == 8 || FMT == 20 || FMT == 39 ? 128 : FMT == 6 ? 32 : FMT == 3 ? 4 : 0; }
// Q2_K: a min per 16 inputs (the others: per 32)
template <int FMT>
constexpr bool mins_per_16() { return FMT == 2; }

// Row l's 32 weight integers of block b of a tile (q4/q5 unsigned, Q6_K and q8 signed), natural input order:
// reference code (portable kernels, dequantize).
template <int FMT, typename V>
static inline void block_values(const uint8_t* qt, int64_t nb, int64_t b, int64_t l, V* out) {
  if constexpr (is_lowbit_kind(FMT)) {
    lowbit_block_values<FMT>(qt, nb, b, l, out);
    return;
  }
  const uint8_t* wb = qt + b * tile_block_bytes<FMT>() + 4 * l;
  const uint8_t* hb = qt + nb * tile_block_bytes<FMT>() + b * high_block_bytes<FMT>() + 4 * l;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      int v;
      if constexpr (FMT == 8) {
        v = wb[64 * j + i];
      } else {  // chunk j % 4: inputs 4j.. in the low nibbles (j < 4), in the high ones (j >= 4)
        const uint8_t byte = wb[64 * (j % 4) + i];
        v = j < 4 ? (byte & 0x0F) : (byte >> 4);
        if constexpr (FMT == 5) v |= ((hb[i] >> j) & 1) << 4;
        if constexpr (FMT == 6) v |= ((hb[64 * (j / 4) + i] >> (2 * (j % 4))) & 3) << 4;
      }
      out[4 * j + i] = static_cast<V>(v - weight_offset<FMT>());
    }
}

// Compact (file-sized) weights: where their scale bytes are, to decode one tile's at a time
struct TileScales {
  int64_t code;        // CompactCode
  const uint8_t* st;   // every tile's scale bytes
  int64_t tile_bytes;  // per tile
};

// ---- one tile (16 weight rows) against R activation rows: res[r * 16 + lane] ----
#if defined(VLITE_AVX512)
static inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16f(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#if defined(__AVX512VNNI__)
// acc += w (u8) . the 4 bytes at x broadcast to every lane, with the broadcast folded into the
// instruction's memory operand ({1to16}): one instruction instead of a broadcast and a multiply
// (compilers do not fold _mm512_set1_epi32 into vpdpbusd by themselves).
static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int32_t* x) {
#if defined(VLITE_NO_INLINE_ASM)
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*x));
#else
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
#endif
}
#endif

// SC: the scales' form: 0 arrays (st, mt); a CompactCode: the tile's scale bytes `ks`, decoded here in
// registers super-block by super-block (no buffer), the same products as decode_tile_scales.
template <int FMT, int SUB, int R, typename S, int SC = 0>
static inline void tile_dot(const uint8_t* qt, const S* st, const S* mt, const Activations& a, int64_t m0,
                            float* res, const uint8_t* pf, const uint8_t* ks = nullptr) {
  constexpr int64_t PER = QK / SUB;
  __m512 kd = _mm512_setzero_ps(), kdmin = kd;  // K-quants: the super-block's d and -dmin
  __m512i ka = _mm512_setzero_si512(), kb = ka, kc = ka;  // its sub-scale/min nibbles and top bits
  __m512 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm512_setzero_ps();
  constexpr int OFF = weight_offset<FMT>();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int64_t high0 = a.nb * tile_block_bytes<FMT>();  // the high plane follows the tile's nibbles
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* wb = qt + b * tile_block_bytes<FMT>();
    const uint8_t* hb = qt + high0 + b * high_block_bytes<FMT>();
    if (pf != nullptr) {  // the next tile's block: DRAM latency hidden behind this tile's arithmetic
      for (int64_t i = 0; i < tile_block_bytes<FMT>(); i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf + b * tile_block_bytes<FMT>() + i), _MM_HINT_T0);
      for (int64_t i = 0; i < high_block_bytes<FMT>(); i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf + high0 + b * high_block_bytes<FMT>() + i), _MM_HINT_T0);
    }
    __m512i w[8];  // w[j]: inputs 4j..4j+3 of the block for the 16 rows (u8)
    if constexpr (is_lowbit_kind(FMT)) {
      lowbit_unpack512<FMT>(wb, hb, w);
    } else if constexpr (FMT == 8) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(wb + 64 * j);
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m512i raw = _mm512_loadu_si512(wb + 64 * p);
        w[p] = _mm512_and_si512(raw, m4);
        w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      }
    }
    if constexpr (FMT == 5) {  // bit j of byte i: input 4j + i's bit 4
      const __m512i h = _mm512_loadu_si512(hb), bit4 = _mm512_set1_epi8(0x10);
      w[0] = _mm512_ternarylogic_epi32(w[0], _mm512_slli_epi16(h, 4), bit4, 0xF8);  // a | (b & c)
      w[1] = _mm512_ternarylogic_epi32(w[1], _mm512_slli_epi16(h, 3), bit4, 0xF8);
      w[2] = _mm512_ternarylogic_epi32(w[2], _mm512_slli_epi16(h, 2), bit4, 0xF8);
      w[3] = _mm512_ternarylogic_epi32(w[3], _mm512_slli_epi16(h, 1), bit4, 0xF8);
      w[4] = _mm512_ternarylogic_epi32(w[4], h, bit4, 0xF8);
      w[5] = _mm512_ternarylogic_epi32(w[5], _mm512_srli_epi16(h, 1), bit4, 0xF8);
      w[6] = _mm512_ternarylogic_epi32(w[6], _mm512_srli_epi16(h, 2), bit4, 0xF8);
      w[7] = _mm512_ternarylogic_epi32(w[7], _mm512_srli_epi16(h, 3), bit4, 0xF8);
    } else if constexpr (FMT == 6) {  // bits 2p, 2p+1 of byte i: input 16h + 4p + i's bits 4, 5
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m512i hv = _mm512_loadu_si512(hb + 64 * h);
        w[4 * h + 0] = _mm512_ternarylogic_epi32(w[4 * h + 0], _mm512_slli_epi16(hv, 4), bits45, 0xF8);
        w[4 * h + 1] = _mm512_ternarylogic_epi32(w[4 * h + 1], _mm512_slli_epi16(hv, 2), bits45, 0xF8);
        w[4 * h + 2] = _mm512_ternarylogic_epi32(w[4 * h + 2], hv, bits45, 0xF8);
        w[4 * h + 3] = _mm512_ternarylogic_epi32(w[4 * h + 3], _mm512_srli_epi16(hv, 2), bits45, 0xF8);
      }
    }
#if !defined(__AVX512VNNI__)
    // without VNNI, 5- and 6-bit weights take q8's path (w + 128 as u8): their int16 pair sums could saturate
    constexpr bool kQ8Path = FMT != 4 && FMT != 2 && FMT != 3;  // Q2_K, Q3_K: u <= 7, as q4's
    if constexpr (FMT == 5 || FMT == 6)
      for (int j = 0; j < 8; ++j) w[j] = _mm512_add_epi8(w[j], _mm512_set1_epi8(static_cast<char>(128 - OFF)));
    __m512i aw[8];  // q8 without VNNI: |w| and w's sign mask (sign trick)
    __mmask64 neg[8];
    if constexpr (kQ8Path) {
      for (int j = 0; j < 8; ++j) {
        const __m512i ws = _mm512_xor_si512(w[j], _mm512_set1_epi8(static_cast<char>(0x80)));
        aw[j] = _mm512_abs_epi8(ws);
        neg[j] = _mm512_movepi8_mask(ws);
      }
    }
#endif
    __m512 s0, s1, mn, mn1;
    if constexpr (SC == 0) {
      s0 = load16f(st + (b * PER) * kTile);
      s1 = PER == 2 ? load16f(st + (b * PER + 1) * kTile) : s0;
      if (mt != nullptr) mn = load16f(mt + (mins_per_16<FMT>() ? 2 * b : b) * kTile);
      if (mins_per_16<FMT>() && mt != nullptr) mn1 = load16f(mt + (2 * b + 1) * kTile);
    } else if constexpr (SC == kQ4_0) {
      s0 = s1 = load16f(reinterpret_cast<const c10::Half*>(ks) + b * kTile);
      mn = _mm512_mul_ps(s0, _mm512_set1_ps(-8.f));
    } else if constexpr (SC == kQ6_K) {
      const uint8_t* p = ks + (b / 8) * compact_superblock_bytes(kQ6_K);
      if (b % 8 == 0) kd = load16f(reinterpret_cast<const c10::Half*>(p));
      const __m128i* sc = reinterpret_cast<const __m128i*>(p + 32 + (b % 8) * 2 * kTile);
      s0 = _mm512_mul_ps(kd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sc))));
      s1 = _mm512_mul_ps(kd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sc + 1))));
    } else {  // Q4_K, Q5_K: sub-block j = b % 8 from nibble j of ka/kb and bits 2j.. (16 + 2j..) of kc
      if (b % 8 == 0) {
        const uint8_t* p = ks + (b / 8) * compact_superblock_bytes(kQ4_K);
        kd = load16f(reinterpret_cast<const c10::Half*>(p));
        kdmin = _mm512_sub_ps(_mm512_setzero_ps(), load16f(reinterpret_cast<const c10::Half*>(p + 32)));
        ka = _mm512_loadu_si512(p + 64);
        kb = _mm512_loadu_si512(p + 128);
        kc = _mm512_loadu_si512(p + 192);
      }
      const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(0x30);
      const __m512i sci = _mm512_or_si512(_mm512_and_si512(ka, m15), _mm512_and_si512(_mm512_slli_epi32(kc, 4), m48));
      const __m512i mni = _mm512_or_si512(_mm512_and_si512(kb, m15), _mm512_and_si512(_mm512_srli_epi32(kc, 12), m48));
      s0 = s1 = _mm512_mul_ps(kd, _mm512_cvtepi32_ps(sci));
      mn = _mm512_mul_ps(kdmin, _mm512_cvtepi32_ps(mni));
      ka = _mm512_srli_epi32(ka, 4);
      kb = _mm512_srli_epi32(kb, 4);
      kc = _mm512_srli_epi32(kc, 2);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int32_t* xi = reinterpret_cast<const int32_t*>(a.q + row * a.K + b * QK);
      __m512i acc0, acc1;
#if defined(__AVX512VNNI__)
      acc0 = acc1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        acc0 = dpbusd_bcast(acc0, w[j], xi + j);
        acc1 = dpbusd_bcast(acc1, w[j + 4], xi + j + 4);
      }
      if constexpr (OFF != 0) {  // the weights carry +128 (q8) or +32 (Q6_K)
        const int32_t* hs = a.isum + row * 2 * a.nb + 2 * b;
        acc0 = _mm512_sub_epi32(acc0, _mm512_set1_epi32(OFF * hs[0]));
        acc1 = _mm512_sub_epi32(acc1, _mm512_set1_epi32(OFF * hs[1]));
      }
#else
      const __m512i ones = _mm512_set1_epi16(1);
      if constexpr (!kQ8Path) {  // u4 x s8 pair sums <= 3810: four of them fit an int16
        __m512i p0 = _mm512_maddubs_epi16(w[0], _mm512_set1_epi32(xi[0]));
        __m512i p1 = _mm512_maddubs_epi16(w[4], _mm512_set1_epi32(xi[4]));
        for (int j = 1; j < 4; ++j) {
          p0 = _mm512_add_epi16(p0, _mm512_maddubs_epi16(w[j], _mm512_set1_epi32(xi[j])));
          p1 = _mm512_add_epi16(p1, _mm512_maddubs_epi16(w[j + 4], _mm512_set1_epi32(xi[j + 4])));
        }
        acc0 = _mm512_madd_epi16(p0, ones);
        acc1 = _mm512_madd_epi16(p1, ones);
        if constexpr (OFF != 0) {  // Q3_K's u carries +4
          const int32_t* hs = a.isum + row * 2 * a.nb + 2 * b;
          acc0 = _mm512_sub_epi32(acc0, _mm512_set1_epi32(OFF * hs[0]));
          acc1 = _mm512_sub_epi32(acc1, _mm512_set1_epi32(OFF * hs[1]));
        }
      } else {
        acc0 = acc1 = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
          const __m512i xb = _mm512_set1_epi32(xi[j]);
          const __m512i sx = _mm512_mask_sub_epi8(xb, neg[j], _mm512_setzero_si512(), xb);
          const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(aw[j], sx), ones);
          if (j < 4) acc0 = _mm512_add_epi32(acc0, p);
          else acc1 = _mm512_add_epi32(acc1, p);
        }
      }
#endif
      const __m512 dx = _mm512_set1_ps(a.d[row * a.nb + b]);
      if constexpr (PER == 1) {
        accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc0, acc1)), _mm512_mul_ps(s0, dx), accf[r]);
      } else {
        accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc0), _mm512_mul_ps(s0, dx), accf[r]);
        accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc1), _mm512_mul_ps(s1, dx), accf[r]);
      }
    }
    if (mins_per_16<FMT>() && mt != nullptr) {  // Q2_K: d * sum(q) of each 16-input half
      for (int r = 0; r < R; ++r) {
        const int64_t row = m0 + r;
        const float d = a.d[row * a.nb + b];
        const int32_t* hs = a.isum + row * 2 * a.nb + 2 * b;
        accf[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(d * static_cast<float>(hs[0])), accf[r]);
        accf[r] = _mm512_fmadd_ps(mn1, _mm512_set1_ps(d * static_cast<float>(hs[1])), accf[r]);
      }
    } else if (SC == 0 ? mt != nullptr : SC != kQ6_K) {
      for (int r = 0; r < R; ++r) accf[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.dsum[(m0 + r) * a.nb + b]), accf[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(res + r * kTile, accf[r]);
}
#elif defined(VLITE_AVX2)
static inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8f(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// AVX2 q4: one block's integer dot products for the whole tile and R activation rows, out[h][0][r]
// (h: the half of 8 weight rows). Inputs 0-15 (the low nibbles) go first, then 16-31 (the high ones),
// so that eight registers hold a pass's weights for both halves and each broadcast activation dword
// feeds two `vpmaddubsw`: half the broadcasts, the kernel's most frequent op after the multiplies
// (loads, 2 a cycle; benchmarks/vector_ops.py). u4 x s8 pair sums <= 3810: all eight chunks of a
// block fit an int16.
template <int R>
static inline void q4_block_ints(const uint8_t* wb, const Activations& a, int64_t m0, int64_t b,
                                 int32_t (*out)[1][R][8]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) int16_t low[R][2][16];  // each row's int16 sums over inputs 0-15, per half
  for (int pass = 0; pass < 2; ++pass) {
    __m256i w[4][2];  // w[p][h]: inputs 4p..4p+3 (+ 16 in the second pass) of the half's 8 rows
    for (int p = 0; p < 4; ++p)
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p + 32 * h));
        w[p][h] = _mm256_and_si256(pass == 0 ? raw : _mm256_srli_epi16(raw, 4), m4);
      }
    for (int r = 0; r < R; ++r) {
      const int32_t* xi = reinterpret_cast<const int32_t*>(a.q + (m0 + r) * a.K + b * QK) + 4 * pass;
      __m256i x = _mm256_set1_epi32(xi[0]);
      __m256i s0 = _mm256_maddubs_epi16(w[0][0], x), s1 = _mm256_maddubs_epi16(w[0][1], x);
      for (int p = 1; p < 4; ++p) {
        x = _mm256_set1_epi32(xi[p]);
        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[p][0], x));
        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[p][1], x));
      }
      __m256i* lo = reinterpret_cast<__m256i*>(low[r]);
      if (pass == 0) {
        _mm256_store_si256(lo, s0);
        _mm256_store_si256(lo + 1, s1);
      } else {
        _mm256_store_si256(reinterpret_cast<__m256i*>(out[0][0][r]),
                           _mm256_madd_epi16(_mm256_add_epi16(_mm256_load_si256(lo), s0), ones));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out[1][0][r]),
                           _mm256_madd_epi16(_mm256_add_epi16(_mm256_load_si256(lo + 1), s1), ones));
      }
    }
  }
}

// AVX2 q8: one block's integer dot products for the whole tile and R activation rows, out[h][sub-block][r]:
// signed weights back (w + 128 -> w) and the sign trick (|w| times sign(x, w)), so the int16 pair sums
// never saturate. As for q4, four chunks at a time for both halves (each broadcast feeds two products),
// |w| computed once per block and held in registers, w read by `vpsignb` from a small buffer: per 32
// products `vpsignb`, `vpmaddubsw`, `vpmaddwd` on the multiplier pipes instead of two `vpsignb` more.
template <int64_t PER, int R>
static inline void q8_block_ints(const uint8_t* wb, const Activations& a, int64_t m0, int64_t b,
                                 int32_t (*out)[PER][R][8]) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  alignas(32) int8_t sw[4][2][32];  // the pass's signed weights
  for (int pass = 0; pass < 2; ++pass) {  // chunks 4 pass .. 4 pass + 3: inputs 16 pass .. 16 pass + 15
    __m256i aw[4][2];  // |w| (128 for -128: as unsigned bytes, right)
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * (4 * pass + j) + 32 * h)), flip);
        _mm256_store_si256(reinterpret_cast<__m256i*>(sw[j][h]), w);
        aw[j][h] = _mm256_abs_epi8(w);
      }
    for (int r = 0; r < R; ++r) {
      const int32_t* xi = reinterpret_cast<const int32_t*>(a.q + (m0 + r) * a.K + b * QK) + 4 * pass;
      __m256i acc[2];
      for (int j = 0; j < 4; ++j) {
        const __m256i x = _mm256_set1_epi32(xi[j]);
        for (int h = 0; h < 2; ++h) {
          const __m256i sx = _mm256_sign_epi8(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(sw[j][h])));
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j][h], sx), ones);
          acc[h] = j == 0 ? p : _mm256_add_epi32(acc[h], p);
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256i* o = reinterpret_cast<__m256i*>(out[h][PER == 2 ? pass : 0][r]);
        _mm256_store_si256(o, PER == 2 || pass == 0 ? acc[h] : _mm256_add_epi32(_mm256_load_si256(o), acc[h]));
      }
    }
  }
}

// AVX2: the tile as two halves of 8 rows (h = 0, 1), each 8 int32 / float lanes, in two passes
// per group of blocks: the integer pass writes each (block, half, sub-block, row) dot product to a
// small buffer, the float pass applies the scales and mins (its accumulators carried
// in `res` from group to group). With only 16 vector registers, one pass doing both spilled the
// unpacked weight registers and the float accumulators to the stack (measured: 87 -> 103 GMAC/s per
// core with the split, kRows 4 -> 8).
// The float pass over rows [R0, R0 + RG) of the block sums ib (R rows) of blocks [b0, b1) (st, mt: from b0 on), both halves
// at once (RG <= 4: 8 accumulators), so that each row's activation scale and mins sum are broadcast once
// for the two. It is bound by its loads: per row and block 4 instead of 6 (half by half, 9 rows at a
// time), for 4 scale loads per group of rows instead of 2. The 4 linears of a SmolLM2-135M layer, one
// thread, AVX2 path: 1 row 80 -> 75 us, 4 164 -> 157, 8 292 -> 281, 16 536 -> 510; the same bits.
template <int64_t PER, int R, int R0, int RG, typename S, bool M16 = false>
static inline void tile_scale_rows(const int32_t (*ib)[2][PER][R][8], const S* st, const S* mt, const Activations& a,
                                   int64_t m0, int64_t b0, int64_t b1, float* res) {
  __m256 acc[RG][2];
  for (int r = 0; r < RG; ++r)
    for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_loadu_ps(res + (R0 + r) * kTile + 8 * h);
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t p = 0; p < PER; ++p) {
      const __m256 sc0 = load8f(st + ((b - b0) * PER + p) * kTile), sc1 = load8f(st + ((b - b0) * PER + p) * kTile + 8);
      for (int r = 0; r < RG; ++r) {
        const __m256 d = _mm256_set1_ps(a.d[(m0 + R0 + r) * a.nb + b]);
        const int32_t* v = ib[b - b0][0][p][R0 + r];
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(v))),
                                    _mm256_mul_ps(sc0, d), acc[r][0]);
        const int32_t* w = ib[b - b0][1][p][R0 + r];
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(w))),
                                    _mm256_mul_ps(sc1, d), acc[r][1]);
      }
    }
    if (M16 && mt != nullptr) {  // Q2_K: a min per 16 inputs, times d * sum(q) of that half
      for (int64_t p = 0; p < PER; ++p) {
        const __m256 mn0 = load8f(mt + ((b - b0) * PER + p) * kTile), mn1 = load8f(mt + ((b - b0) * PER + p) * kTile + 8);
        for (int r = 0; r < RG; ++r) {
          const int64_t row = m0 + R0 + r;
          const __m256 ds = _mm256_set1_ps(a.d[row * a.nb + b] * static_cast<float>(a.isum[row * 2 * a.nb + 2 * b + p]));
          acc[r][0] = _mm256_fmadd_ps(mn0, ds, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(mn1, ds, acc[r][1]);
        }
      }
    } else if (mt != nullptr) {
      const __m256 mn0 = load8f(mt + (b - b0) * kTile), mn1 = load8f(mt + (b - b0) * kTile + 8);
      for (int r = 0; r < RG; ++r) {
        const __m256 ds = _mm256_set1_ps(a.dsum[(m0 + R0 + r) * a.nb + b]);
        acc[r][0] = _mm256_fmadd_ps(mn0, ds, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(mn1, ds, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(res + (R0 + r) * kTile + 8 * h, acc[r][h]);
}

// The float pass from group I on, the rows in near-equal groups of at most 4
template <int64_t PER, int R, int I, typename S, bool M16 = false>
static inline void tile_scale_groups(const int32_t (*ib)[2][PER][R][8], const S* st, const S* mt, const Activations& a,
                                     int64_t m0, int64_t b0, int64_t b1, float* res) {
  constexpr int NG = (R + 3) / 4;
  if constexpr (I < NG) {
    constexpr int lo = I * R / NG, hi = (I + 1) * R / NG;
    tile_scale_rows<PER, R, lo, hi - lo, S, M16>(ib, st, mt, a, m0, b0, b1, res);
    tile_scale_groups<PER, R, I + 1, S, M16>(ib, st, mt, a, m0, b0, b1, res);
  }
}

// AVX2, 5- and 6-bit weights (nibbles + high plane): one block as q8's tile block (w + 128 as u8), for
// tile_dot_i16's int16 rows
// (rows 8h..8h+7 for h in [h0, h1))
template <int FMT>
static inline void high_block_to_q8(const uint8_t* wb, const uint8_t* hb, uint8_t* out, int h0 = 0, int h1 = 2) {
  constexpr int OFF = weight_offset<FMT>();
  const __m256i m4 = _mm256_set1_epi8(0x0F), add = _mm256_set1_epi8(static_cast<char>(128 - OFF));
  const __m256i mask = _mm256_set1_epi8(FMT == 5 ? 0x10 : 0x30);
  for (int h = h0; h < h1; ++h) {  // rows 8h..8h+7
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p + 32 * h));
      for (int half = 0; half < 2; ++half) {  // chunk j = 4 half + p: inputs 4j..4j+3
        const int j = 4 * half + p;
        const __m256i lo = _mm256_and_si256(half == 0 ? raw : _mm256_srli_epi16(raw, 4), m4);
        __m256i hi;
        if constexpr (FMT == 5) {  // bit j -> bit 4
          const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + 32 * h));
          hi = j <= 4 ? _mm256_slli_epi16(hv, 4 - j) : _mm256_srli_epi16(hv, j - 4);
        } else {  // bits 2p, 2p+1 of plane `half` -> bits 4, 5
          const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + 64 * half + 32 * h));
          hi = p <= 2 ? _mm256_slli_epi16(hv, 4 - 2 * p) : _mm256_srli_epi16(hv, 2);
        }
        const __m256i v = _mm256_or_si256(lo, _mm256_and_si256(hi, mask));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * j + 32 * h), _mm256_add_epi8(v, add));
      }
    }
  }
}

// AVX2, 5- and 6-bit weights straight from the tile (nibbles + high plane), for R activation rows, out as
// q8_block_ints': the unsigned values (Q5_K q in 0..31; Q6_K q = w + 32 in 0..63) times the s8 activations
// (`vpmaddubsw`), the pair sums of CH chunks added in int16 (Q6_K: 2 x 2 x 63 x 128 = 32,256; Q5_K: four
// chunks, 31,744: no saturation), then widened; Q6_K's +32 comes off with the half block's activation sum
// (isum), as the VNNI path does. Like q4, the pass's weights stay in registers while the rows go by: per 32
// products ~2.5 instructions instead of q8's sign trick (4, plus the detour through q8's bytes in memory).
// Measured, 2 threads, Zen 3: a Q6_K LM head 248,320 x 2,048 at 16 rows 89 -> 106-113 GMAC/s; a Q6_K down
// projection 2,048 x 6,144 at 16 rows 76 -> 111-119, at 1 row 34 -> 48 (Q4_K there: 136-160).
template <int FMT, int64_t PER, int R>
static inline void high_block_ints(const uint8_t* wb, const uint8_t* hb, const Activations& a, int64_t m0,
                                   int64_t b, int32_t (*out)[PER][R][8]) {
  constexpr int OFF = weight_offset<FMT>();
  constexpr int CH = FMT == 6 ? 2 : 4;  // chunks whose pair sums fit one int16
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i mask = _mm256_set1_epi8(FMT == 5 ? 0x10 : 0x30);
  for (int pass = 0; pass < 2; ++pass) {  // inputs 16 pass .. 16 pass + 15: the low, then the high nibbles
    __m256i w[4][2];  // w[p][h]: inputs 16 pass + 4p .. + 3 of the half's 8 rows
    for (int p = 0; p < 4; ++p)
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p + 32 * h));
        const __m256i lo = _mm256_and_si256(pass == 0 ? raw : _mm256_srli_epi16(raw, 4), m4);
        __m256i hi;
        if constexpr (FMT == 5) {  // bit j of the plane's byte -> bit 4 (chunk j = 4 pass + p)
          const int j = 4 * pass + p;
          const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + 32 * h));
          hi = j <= 4 ? _mm256_slli_epi16(hv, 4 - j) : _mm256_srli_epi16(hv, j - 4);
        } else {  // bits 2p, 2p+1 of plane `pass` -> bits 4, 5
          const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + 64 * pass + 32 * h));
          hi = p <= 2 ? _mm256_slli_epi16(hv, 4 - 2 * p) : _mm256_srli_epi16(hv, 2);
        }
        w[p][h] = _mm256_or_si256(lo, _mm256_and_si256(hi, mask));
      }
    for (int r = 0; r < R; ++r) {
      const int32_t* xi = reinterpret_cast<const int32_t*>(a.q + (m0 + r) * a.K + b * QK) + 4 * pass;
      __m256i acc[2];
      for (int c = 0; c < 4; c += CH) {
        __m256i s[2];
        for (int j = c; j < c + CH; ++j) {
          const __m256i x = _mm256_set1_epi32(xi[j]);
          for (int h = 0; h < 2; ++h) {
            const __m256i prod = _mm256_maddubs_epi16(w[j][h], x);
            s[h] = j == c ? prod : _mm256_add_epi16(s[h], prod);
          }
        }
        for (int h = 0; h < 2; ++h) {
          const __m256i wide = _mm256_madd_epi16(s[h], ones);
          acc[h] = c == 0 ? wide : _mm256_add_epi32(acc[h], wide);
        }
      }
      if constexpr (OFF != 0) {
        const __m256i off = _mm256_set1_epi32(OFF * a.isum[(m0 + r) * 2 * a.nb + 2 * b + pass]);
        for (int h = 0; h < 2; ++h) acc[h] = _mm256_sub_epi32(acc[h], off);
      }
      for (int h = 0; h < 2; ++h) {
        __m256i* o = reinterpret_cast<__m256i*>(out[h][PER == 2 ? pass : 0][r]);
        _mm256_store_si256(o, PER == 2 || pass == 0 ? acc[h] : _mm256_add_epi32(_mm256_load_si256(o), acc[h]));
      }
    }
  }
}

// 5- and 6-bit weights and the kinds of gguf_kinds.h: one block (rows 8h..8h+7 for h in [h0, h1)) as q8's
// tile block (w + 128 as u8)
template <int FMT>
static inline void block_to_q8(const uint8_t* wb, const uint8_t* hb, uint8_t* out, int h0 = 0, int h1 = 2) {
  if constexpr (is_lowbit_kind(FMT)) lowbit_block_to_q8<FMT>(wb, hb, out, h0, h1);
  else high_block_to_q8<FMT>(wb, hb, out, h0, h1);
}

// The scales (sp) and mins (mp) of blocks [b0, b1): the arrays' from b0 on, or a compact weight's (its scale
// bytes `ks`, GGUF type `code`) decoded into gsc and gmn
template <int64_t PER, typename S>
static inline void group_scales(const S* st, const S* mt, int64_t code, const uint8_t* ks, int64_t b0, int64_t b1,
                                float* gsc, float* gmn, const S*& sp, const S*& mp) {
  sp = st != nullptr ? st + b0 * PER * kTile : nullptr;
  mp = mt != nullptr ? mt + b0 * kTile : nullptr;
  if constexpr (std::is_same_v<S, float>) {
    if (ks != nullptr) {
      decode_scales(code, ks, b0, b1, gsc, gmn);
      sp = gsc;
      mp = compact_has_mins(code) ? gmn : nullptr;
    }
  }
}

// Never inlined: inlined into the caller's loop (as GCC chose for 8 rows once the passes grew to 16)
// its 8-row pass ran 10% slower.
// Compact weights (`code`, their scale bytes `ks`; st and mt unused): each group's scales decoded first.
template <int FMT, int SUB, int R, typename S>
__attribute__((noinline)) void tile_dot(const uint8_t* qt, const S* st, const S* mt, const Activations& a, int64_t m0,
                                        float* res, const uint8_t* pf, int64_t code = 0, const uint8_t* ks = nullptr) {
  constexpr int64_t PER = QK / SUB;
  static_assert(FMT != 4 || PER == 1, "q4 blocks have one scale");
  constexpr int64_t G = PER == 2 ? 8 : 16;  // blocks per pass (the buffer: <= 16 KB)
  alignas(32) int32_t ib[G][2][PER][R][8];
  alignas(32) float gsc[G * PER * kTile], gmn[G * PER * kTile];  // a compact weight's group of scales
  const int64_t high0 = a.nb * tile_block_bytes<FMT>();  // the high plane follows the tile's nibbles
  for (int64_t i = 0; i < R * kTile; ++i) res[i] = 0.f;
  for (int64_t b0 = 0; b0 < a.nb; b0 += G) {
    const int64_t b1 = std::min(a.nb, b0 + G);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = qt + b * tile_block_bytes<FMT>();
      if (pf != nullptr) {  // the next tile's block: DRAM latency hidden behind this tile's arithmetic
        for (int64_t i = 0; i < tile_block_bytes<FMT>(); i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pf + b * tile_block_bytes<FMT>() + i), _MM_HINT_T0);
        for (int64_t i = 0; i < high_block_bytes<FMT>(); i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pf + high0 + b * high_block_bytes<FMT>() + i), _MM_HINT_T0);
      }
      if constexpr (FMT == 4) {
        q4_block_ints<R>(wb, a, m0, b, ib[b - b0]);
      } else if constexpr (FMT == 8) {
        q8_block_ints<PER, R>(wb, a, m0, b, ib[b - b0]);
      } else if constexpr (FMT == 2 || FMT == 3) {
        lowbit_u_block_ints<FMT, R>(wb, qt + high0 + b * high_block_bytes<FMT>(), a, m0, b, ib[b - b0]);
      } else {
        if constexpr (FMT == 5 || FMT == 6) {
          high_block_ints<FMT, PER, R>(wb, qt + high0 + b * high_block_bytes<FMT>(), a, m0, b, ib[b - b0]);
        } else {  // the table kinds (IQ4_NL, IQ4_XS, MXFP4): signed int8 values, q8's sign trick
          alignas(32) uint8_t q8[tile_block_bytes<8>()];
          block_to_q8<FMT>(wb, qt + high0 + b * high_block_bytes<FMT>(), q8);
          q8_block_ints<PER, R>(q8, a, m0, b, ib[b - b0]);
        }
      }
    }
    const S* sp;
    const S* mp;
    group_scales<PER>(st, mt, code, ks, b0, b1, gsc, gmn, sp, mp);
    tile_scale_groups<PER, R, 0, S, mins_per_16<FMT>()>(ib, sp, mp, a, m0, b0, b1, res);
  }
}

// AVX2 q4, one or two activation rows (decode; a precise row's value and residual): one pass, the block's
// integer sums straight into the float accumulators, without tile_dot's buffer of block sums, which at so few
// rows cost as much as the products. The same operations per block in the same order as tile_dot: the same bits.
template <int R, typename S>
__attribute__((noinline)) void tile_dot_q4_rows(const uint8_t* qt, const S* st, const S* mt, const Activations& a,
                                                int64_t m0, float* res, const uint8_t* pf, int64_t code = 0,
                                                const uint8_t* ks = nullptr) {
  constexpr int64_t G = 16, BB = tile_block_bytes<4>();
  alignas(32) float gsc[G * kTile], gmn[G * kTile];
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < a.nb; b0 += G) {
    const int64_t b1 = std::min(a.nb, b0 + G);
    const S* sp;
    const S* mp;
    group_scales<1>(st, mt, code, ks, b0, b1, gsc, gmn, sp, mp);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = qt + b * BB;
      if (pf != nullptr)
        for (int64_t i = 0; i < BB; i += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + b * BB + i), _MM_HINT_T0);
      __m256i s[R][2];
      for (int p = 0; p < 4; ++p) {
        __m256i w[2][2];  // w[h][nibble]: inputs 4p..4p+3 (low) and 16 + 4p.. (high) of half h's 8 rows
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p + 32 * h));
          w[h][0] = _mm256_and_si256(raw, m4);
          w[h][1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
        for (int r = 0; r < R; ++r) {
          const int32_t* xi = reinterpret_cast<const int32_t*>(a.q + (m0 + r) * a.K + b * QK);
          const __m256i xl = _mm256_set1_epi32(xi[p]), xh = _mm256_set1_epi32(xi[4 + p]);
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_add_epi16(_mm256_maddubs_epi16(w[h][0], xl), _mm256_maddubs_epi16(w[h][1], xh));
            s[r][h] = p == 0 ? v : _mm256_add_epi16(s[r][h], v);
          }
        }
      }
      const __m256 sc0 = load8f(sp + (b - b0) * kTile), sc1 = load8f(sp + (b - b0) * kTile + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(a.d[(m0 + r) * a.nb + b]);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][0], ones)), _mm256_mul_ps(sc0, d),
                                    acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][1], ones)), _mm256_mul_ps(sc1, d),
                                    acc[r][1]);
      }
      if (mp != nullptr) {
        const __m256 mn0 = load8f(mp + (b - b0) * kTile), mn1 = load8f(mp + (b - b0) * kTile + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 ds = _mm256_set1_ps(a.dsum[(m0 + r) * a.nb + b]);
          acc[r][0] = _mm256_fmadd_ps(mn0, ds, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(mn1, ds, acc[r][1]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(res + r * kTile + 8 * h, acc[r][h]);
}

// q8 weights against float32 activations on AVX2: the (value, residual) int8 pair of a row as one
// int16 value (256 q + q_res, the same number), multiplied by the sign-extended weights with
// `vpmaddwd`: the same products as the pair of int8 rows, in ~half the instructions (no sign trick,
// one multiply per weight instead of two). Lanes come out of `vphaddd` in the order 0 1 4 5 2 3 6 7;
// scales and mins are permuted alike and the result is put back in order at the end.
// 5- and 6-bit weights (Q5_K, Q6_K) take the same path, each half block first unpacked to q8's bytes.
template <int FMT, int SUB, int R, typename S>
static inline void tile_dot_i16(const uint8_t* qt, const S* st, const S* mt, const Activations& a, int64_t m0,
                                float* res, const uint8_t* pf) {
  constexpr int64_t PER = QK / SUB;
  const __m256i perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const int64_t high0 = a.nb * tile_block_bytes<FMT>();
  alignas(32) uint8_t q8[tile_block_bytes<8>()];
  for (int h = 0; h < 2; ++h) {
    __m256 accf[R];
    for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* wb = qt + b * tile_block_bytes<FMT>() + 32 * h;
      if (pf != nullptr && h == 0) {
        for (int64_t i = 0; i < tile_block_bytes<FMT>(); i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pf + b * tile_block_bytes<FMT>() + i), _MM_HINT_T0);
        for (int64_t i = 0; i < high_block_bytes<FMT>(); i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pf + high0 + b * high_block_bytes<FMT>() + i), _MM_HINT_T0);
      }
      if constexpr (FMT != 8) {
        block_to_q8<FMT>(qt + b * tile_block_bytes<FMT>(), qt + high0 + b * high_block_bytes<FMT>(), q8, h, h + 1);
        wb = q8 + 32 * h;
      }
      __m256 sc[PER];
      for (int64_t p = 0; p < PER; ++p)
        sc[p] = _mm256_permutevar8x32_ps(load8f(st + (b * PER + p) * kTile + 8 * h), perm);
      for (int64_t p = 0; p < PER; ++p) {
        __m256i lo[R], hi[R];
        for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
        for (int j = 4 * p * (PER == 2 ? 1 : 0); j < (PER == 2 ? 4 * (p + 1) : 8); ++j) {
          const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j)), flip);
          const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));       // rows 0-3
          const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));  // rows 4-7
          for (int r = 0; r < R; ++r) {
            int64_t xv;
            std::memcpy(&xv, a.q16 + (m0 + r) * a.K + b * QK + 4 * j, sizeof(xv));
            const __m256i xb = _mm256_set1_epi64x(xv);
            lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(w0, xb));
            hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(w1, xb));
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m256 dx = _mm256_set1_ps(a.d16[(m0 + r) * a.nb + b]);
          accf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[r], hi[r])), _mm256_mul_ps(sc[p], dx),
                                    accf[r]);
        }
      }
      if (mt != nullptr) {
        const __m256 mn = _mm256_permutevar8x32_ps(load8f(mt + b * kTile + 8 * h), perm);
        for (int r = 0; r < R; ++r)
          accf[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.dsum16[(m0 + r) * a.nb + b]), accf[r]);
      }
    }
    for (int r = 0; r < R; ++r)  // back in row order (the permutation is its own inverse)
      _mm256_storeu_ps(res + r * kTile + 8 * h, _mm256_permutevar8x32_ps(accf[r], perm));
  }
}
#else
// portable: the same sums in plain C++ over the same layout
template <int FMT, int SUB, int R, typename S>
static inline void tile_dot(const uint8_t* qt, const S* st, const S* mt, const Activations& a, int64_t m0,
                            float* res, const uint8_t* pf) {
  constexpr int64_t PER = QK / SUB;
  float accf[R][kTile] = {};
  for (int64_t b = 0; b < a.nb; ++b) {
    int32_t w[kTile][QK];  // signed weight values, natural input order
    for (int l = 0; l < kTile; ++l) block_values<FMT>(qt, a.nb, b, l, w[l]);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int8_t* x = a.q + row * a.K + b * QK;
      const float dx = a.d[row * a.nb + b];
      for (int l = 0; l < kTile; ++l) {
        for (int64_t s = 0; s < PER; ++s) {
          int32_t sum = 0;
          for (int64_t i = s * SUB; i < (s + 1) * SUB; ++i) sum += w[l][i] * x[i];
          accf[r][l] += to_float(st[(b * PER + s) * kTile + l]) * dx * static_cast<float>(sum);
        }
        if (mt != nullptr && mins_per_16<FMT>()) {  // Q2_K: d * sum(q) of each 16-input half
          for (int64_t s = 0; s < 2; ++s)
            accf[r][l] += to_float(mt[(2 * b + s) * kTile + l]) *
                          (dx * static_cast<float>(a.isum[row * 2 * a.nb + 2 * b + s]));
        } else if (mt != nullptr) {
          accf[r][l] += to_float(mt[b * kTile + l]) * a.dsum[row * a.nb + b];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < kTile; ++l) res[r * kTile + l] = accf[r][l];
}
#endif

// f(std::integral_constant<int, rows>()) for a run-time 1 <= rows <= N: the kernels' row counts are
// template arguments so their accumulators stay in registers
template <int N, typename F>
static inline void with_rows(int64_t rows, F&& f) {
  if constexpr (N > 1) {
    if (rows < N) return with_rows<N - 1>(rows, f);
  }
  f(std::integral_constant<int, N>());
}

// M activation rows (2 per output row with `pairs`: value and residual, summed) x N weight rows
// `ts`: compact weights, whose scales (S = float) are decoded tile by tile (st and mt unused)
template <int FMT, int SUB, typename S, typename T>
void gemm_impl(const Activations& a, int64_t M, const uint8_t* qt, const S* st, const S* mt, int64_t N, T* out,
               bool pairs, const T* residual, const TileScales* ts = nullptr) {
  const int64_t tiles = (N + kTile - 1) / kTile;
  const int64_t tile_bytes = a.nb * (tile_block_bytes<FMT>() + high_block_bytes<FMT>());
  const int64_t scales_per_tile = (a.K / SUB) * kTile, mins_per_tile = (mins_per_16<FMT>() ? 2 : 1) * a.nb * kTile;
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, M * a.nb));
  // rows [r0, r0 + rows) of res -> out (one output row per `step` activation rows)
  auto store = [&](const float* res, int64_t r0, int64_t rows, int64_t step, int64_t n0, int64_t lanes) {
    for (int64_t r = 0; r + step - 1 < rows; r += step) {
      const int64_t o = ((r0 + r) / step) * N + n0;
      if (lanes == kTile) {  // a whole tile: 16 lanes at once
        Vec16 v = Vec16::load(res + r * kTile);
        if (step == 2) v = v + Vec16::load(res + (r + 1) * kTile);
        if (residual != nullptr) v = v + Vec16::load(residual + o);
        store16(out + o, v);
        continue;
      }
      for (int64_t l = 0; l < lanes; ++l) {
        float v = step == 2 ? res[r * kTile + l] + res[(r + 1) * kTile + l] : res[r * kTile + l];
        if (residual != nullptr) v += to_float(residual[o + l]);
        out[o + l] = static_cast<T>(v);
      }
    }
  };
  // the tile's scales and mins: from the arrays, or a compact weight's decoded into this thread's buffers
  // (`whole`: the tile's at once; else AVX-512 decodes them in the kernel's registers (tile_dot's SC), AVX2
  // group by group (tile_dot's ks))
  auto tile_scales = [&](int64_t t, const S*& s, const S*& mn, bool whole = false) {
#if defined(VLITE_AVX512) || defined(VLITE_AVX2)
    // (AVX-512: gguf_kinds.h's types read their tile's scales decoded whole, as the arrays)
    if (ts != nullptr && !whole && !(kIsAvx512 && is_lowbit(ts->code))) {
      s = mn = nullptr;
      return;
    }
#endif
    if constexpr (std::is_same_v<S, float>) {
      if (ts != nullptr) {
        thread_local std::vector<float> sc_buf, mn_buf;
        sc_buf.resize(scales_per_tile);
        mn_buf.resize(mins_per_tile);
        decode_tile_scales(ts->code, ts->st + t * ts->tile_bytes, a.K, sc_buf.data(), mn_buf.data());
        s = sc_buf.data();
        mn = compact_has_mins(ts->code) ? mn_buf.data() : nullptr;
        return;
      }
    }
    s = st + t * scales_per_tile;
    mn = mt != nullptr ? mt + t * mins_per_tile : nullptr;
  };
#if defined(VLITE_AVX2)
  if constexpr (FMT != 4 && !mins_per_16<FMT>()) {
    if (a.q16 != nullptr) {  // M / 2 int16 rows (pairs), one output row each
      const int64_t MO = M / 2;
      at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
        alignas(64) float res[kRows * kTile];
        for (int64_t t = begin; t < end; ++t) {
          const uint8_t* q = qt + t * tile_bytes;
          const S* s;
          const S* mn;
          tile_scales(t, s, mn, true);
          const uint8_t* next = t + 1 < end ? q + tile_bytes : nullptr;
          for (int64_t m = 0; m < MO; m += 4) {
            const int64_t rows = std::min<int64_t>(4, MO - m);
            const uint8_t* pf = m == 0 ? next : nullptr;
            with_rows<4>(rows, [&](auto r) { tile_dot_i16<FMT, SUB, decltype(r)::value>(q, s, mn, a, m, res, pf); });
            store(res, m, rows, 1, t * kTile, std::min(kTile, N - t * kTile));
          }
        }
      });
      return;
    }
  }
#endif
  // Long steps (prefill chunks) take the rows in blocks whose int8 activations stay in L2 while
  // every tile of the thread's share passes over them (2,048 rows at once: 127 -> 147 GMAC/s, AVX2).
  const int64_t m_block = std::max<int64_t>(4 * kRows, (kActivationBlockBytes / a.K) / kRows * kRows);
  // q4 weights: a step's last 9 rows (a verify step of 1 + 8 tokens) in one pass instead of 8 and then
  // 1, which unpacked every weight block again for one row (the four linears of a SmolLM2-135M layer
  // at 9 rows: AVX2 209 -> 190 us, AVX-512 VNNI 123 -> 110 us). Not for q8 weights: their 9-row pass
  // was slower (AVX2 LM head 2.2 -> 2.5 ms). Never splits a (value, residual) pair of rows.
#if defined(VLITE_AVX2)
  // AVX2 q4: up to 16 rows a pass (its integer pass holds the weights in registers and takes the rows
  // one by one; the float pass 9 at most at a time), so a verify step of up to 1 + 15 tokens unpacks each
  // weight block once: a pass costs ~1 row's time on top of its rows (measured, the 120 body linears
  // of SmolLM2-135M, one thread: 10 rows 11.9 -> 10.5 ms, 12 13.9 -> 12.5, 16 17.1 -> 16.2, 8 unchanged).
  constexpr bool merge = false;
  constexpr int kPass = FMT == 4 ? 16 : kRows;
#else
  constexpr bool merge = FMT == 4;
  constexpr int kPass = merge ? kRows + 1 : kRows;  // the most rows of one pass
#endif
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float res[kPass * kTile];
    for (int64_t m_begin = 0; m_begin < M; m_begin += m_block) {
      const int64_t m_end = std::min(M, m_begin + m_block);
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* q = qt + t * tile_bytes;
        const S* s;
        const S* mn;
        tile_scales(t, s, mn);
        const uint8_t* next = t + 1 < end ? q + tile_bytes : nullptr;
        for (int64_t m = m_begin, rows; m < m_end; m += rows) {
          if constexpr (kPass > kRows + 1) {  // near-equal passes of at most kPass rows (an even count with pairs)
            const int64_t left = m_end - m, passes = (left + kPass - 1) / kPass;
            rows = std::min<int64_t>(left, pairs ? ((left + passes - 1) / passes + 1) / 2 * 2 : (left + passes - 1) / passes);
          } else {
            rows = merge && !pairs && m_end - m == kRows + 1 ? kRows + 1 : std::min<int64_t>(kRows, m_end - m);
          }
          const uint8_t* pf = m == m_begin ? next : nullptr;
#if defined(VLITE_AVX512)
          if (!is_lowbit_kind(FMT) && ts != nullptr) {
            const uint8_t* ks = ts->st + t * ts->tile_bytes;
            with_rows<kPass>(rows, [&](auto r) {
              constexpr int R = decltype(r)::value;
              if constexpr (is_lowbit_kind(FMT)) {}  // (not reached: their scales are decoded as arrays)
              else if constexpr (FMT == 6) tile_dot<FMT, SUB, R, S, kQ6_K>(q, s, mn, a, m, res, pf, ks);
              else if constexpr (FMT == 5) tile_dot<FMT, SUB, R, S, kQ4_K>(q, s, mn, a, m, res, pf, ks);
              else if (ts->code == kQ4_0) tile_dot<FMT, SUB, R, S, kQ4_0>(q, s, mn, a, m, res, pf, ks);
              else tile_dot<FMT, SUB, R, S, kQ4_K>(q, s, mn, a, m, res, pf, ks);
            });
          } else {
            with_rows<kPass>(rows, [&](auto r) { tile_dot<FMT, SUB, decltype(r)::value>(q, s, mn, a, m, res, pf); });
          }
#elif defined(VLITE_AVX2)
          const uint8_t* ks = ts != nullptr ? ts->st + t * ts->tile_bytes : nullptr;
          const int64_t code = ts != nullptr ? ts->code : 0;
          if (FMT == 4 && rows <= 2) {
            with_rows<2>(rows, [&](auto r) { tile_dot_q4_rows<decltype(r)::value>(q, s, mn, a, m, res, pf, code, ks); });
          } else {
            with_rows<kPass>(rows, [&](auto r) {
              tile_dot<FMT, SUB, decltype(r)::value>(q, s, mn, a, m, res, pf, code, ks);
            });
          }
#else
          with_rows<kPass>(rows, [&](auto r) { tile_dot<FMT, SUB, decltype(r)::value>(q, s, mn, a, m, res, pf); });
#endif
          store(res, m, rows, pairs ? 2 : 1, t * kTile, std::min(kTile, N - t * kTile));
        }
      }
    }
  });
}

void check_compact(const at::Tensor& qt, const at::Tensor& st, const c10::optional<at::Tensor>& mt,
                   int64_t code, int64_t sub, int64_t N, int64_t K) {
  const int64_t block = compact_block(code), tiles = (N + kTile - 1) / kTile;
  TORCH_CHECK(K % block == 0, "K must be a multiple of ", block, " for GGUF type code ", code, ", got ", K);
  TORCH_CHECK(sub == compact_sub(code), "sub must be ", compact_sub(code), " for GGUF type code ", code);
  const int64_t qt_cols = K * kTile * compact_weight_bits(code) / 8;
  TORCH_CHECK(N > 0 && qt.is_contiguous() && qt.scalar_type() == at::kByte && qt.dim() == 2 && qt.size(0) == tiles &&
              qt.size(1) == qt_cols, "bad tiled weight: expected uint8 [", tiles, ", ", qt_cols, "] for N=", N,
              ", K=", K);
  TORCH_CHECK(!mt.has_value(), "GGUF type code ", code, " takes no mins tensor: its mins are in its scales");
  if (code == kQ4_0 || code == kIQ4_NL || code == kMXFP4) {
    const auto dt = code == kMXFP4 ? at::kByte : at::kHalf;
    TORCH_CHECK(st.is_contiguous() && st.scalar_type() == dt && st.dim() == 3 && st.size(0) == tiles &&
                st.size(1) == K / QK && st.size(2) == kTile, "bad tiled scales: expected ", dt, " [", tiles, ", ",
                K / QK, ", 16]");
  } else {
    TORCH_CHECK(st.is_contiguous() && st.scalar_type() == at::kByte && st.dim() == 3 && st.size(0) == tiles &&
                st.size(1) == K / 256 && st.size(2) == compact_superblock_bytes(code), "bad tiled scales: expected "
                "uint8 [", tiles, ", ", K / 256, ", ", compact_superblock_bytes(code), "]");
  }
}

void check_tiled(const at::Tensor& qt, const at::Tensor& st, const c10::optional<at::Tensor>& mt,
                 int64_t fmt, int64_t sub, int64_t N, int64_t K) {
  if (is_compact(fmt)) return check_compact(qt, st, mt, fmt, sub, N, K);
  TORCH_CHECK(fmt == 4 || fmt == 8, "fmt must be 4, 8 or a GGUF type code (2, 10, 11, 12, 13, 14, 20, 23, 39), got ",
              fmt);
  TORCH_CHECK(sub == 32 || (sub == 16 && fmt == 8), "sub must be 32 (or 16 for q8)");
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  const int64_t tiles = (N + kTile - 1) / kTile;
  TORCH_CHECK(N > 0 && qt.is_contiguous() && qt.scalar_type() == at::kByte && qt.dim() == 2 && qt.size(0) == tiles &&
              qt.size(1) == K * kTile / (fmt == 4 ? 2 : 1), "bad tiled weight: expected uint8 [", tiles, ", ",
              K * kTile / (fmt == 4 ? 2 : 1), "] for N=", N, ", K=", K);
  TORCH_CHECK(st.is_contiguous() && st.dim() == 3 && st.size(0) == tiles && st.size(1) == K / sub &&
              st.size(2) == kTile, "bad tiled scales");
  TORCH_CHECK(st.scalar_type() == at::kHalf || st.scalar_type() == at::kFloat, "scales: float16 or float32");
  if (mt.has_value()) {
    TORCH_CHECK(mt->is_contiguous() && mt->dim() == 3 && mt->size(0) == tiles && mt->size(1) == K / QK &&
                mt->size(2) == kTile, "bad tiled mins");
    TORCH_CHECK(mt->scalar_type() == st.scalar_type(), "mins and scales must share a dtype");
  }
}
}  // namespace

// x [M, K] float32/bf16 -> (int8 [R, K], float32 d [R, K/32], float32 d * sum(q) [R, K/32],
// int32 sum(q) per 16 inputs [R, K/16]), R = M, or 2M with `precise` (rows 2m, 2m+1: value and
// residual of x[m])
std::vector<at::Tensor> quantize_activations(at::Tensor x, bool precise) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % QK == 0, "x must be [M, K] with K a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), R = precise ? 2 * M : M;
  auto q = at::empty({R, K}, at::kChar);
  auto d = at::empty({R, K / QK}, at::kFloat);
  auto ds = at::empty({R, K / QK}, at::kFloat);
  auto is = at::empty({R, 2 * (K / QK)}, at::kInt);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    quantize_rows(xc.data_ptr<T>(), M, K, precise, q.data_ptr<int8_t>(), d.data_ptr<float>(), ds.data_ptr<float>(),
                  is.data_ptr<int32_t>());
  };
  if (xc.scalar_type() == at::kFloat) run(float());
  else if (xc.scalar_type() == at::kBFloat16) run(c10::BFloat16());
  else TORCH_CHECK(false, "quantize_activations: float32 or bfloat16 only");
  return {q, d, ds, is};
}

// y [M, N] (x's dtype, or out_dtype: float32 or bfloat16) = x [M, K] @ dequant(W).T (+ residual [M, N])
// for a row-tiled packed weight (fmt 4: q4, 8: q8) of N rows. `precise`: each activation row also
// gets an int8 residual row (~16-bit products), else a single int8 row; by default float32
// activations in steps of at most kPreciseMaxRows rows (`precise_rows`, else x's rows, counts the step).
// `residual`: a skip connection (of the output's dtype) added in float32 as the outputs are written.
// The sums are float32 whatever the dtypes: a float32 output of bf16 activations (the LM head's
// logits) is not rounded to bf16.
at::Tensor quant_linear(at::Tensor x, at::Tensor qt, at::Tensor st, c10::optional<at::Tensor> mt, int64_t fmt,
                        int64_t sub, int64_t N, c10::optional<at::Tensor> residual, c10::optional<bool> precise_opt,
                        c10::optional<at::ScalarType> out_dtype, c10::optional<int64_t> precise_rows) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t M = x.size(0), K = x.size(1);
  check_tiled(qt, st, mt, fmt, sub, N, K);
  const at::ScalarType odt = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(odt == at::kFloat || odt == at::kBFloat16, "quant_linear: out_dtype must be float32 or bfloat16");
  auto out = at::empty({M, N}, x.options().dtype(odt));
  if (residual.has_value())
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == odt && residual->dim() == 2 &&
                residual->size(0) == M && residual->size(1) == N, "quant_linear: residual must be a contiguous [M, N] "
                "tensor of the output's dtype");
  if (M == 0) return out;
  const bool precise = precise_opt.value_or(x.scalar_type() == at::kFloat &&
                                            precise_rows.value_or(M) <= kPreciseMaxRows);
  // The int8 activations live in a per-thread scratch: four small tensor allocations per call cost
  // more than quantizing a decode token (121 calls per decode step of the default model).
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> d_buf, ds_buf;
  thread_local std::vector<int32_t> is_buf;
  const int64_t rows = precise ? 2 * M : M, nb = K / QK;
  if (static_cast<int64_t>(q_buf.size()) < rows * K) q_buf.resize(rows * K);
  if (static_cast<int64_t>(d_buf.size()) < rows * nb) { d_buf.resize(rows * nb); ds_buf.resize(rows * nb); }
  if (static_cast<int64_t>(is_buf.size()) < rows * 2 * nb) is_buf.resize(rows * 2 * nb);
  auto xc = x.contiguous();
  if (xc.scalar_type() == at::kFloat)
    quantize_rows(xc.data_ptr<float>(), M, K, precise, q_buf.data(), d_buf.data(), ds_buf.data(), is_buf.data());
  else if (xc.scalar_type() == at::kBFloat16)
    quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K, precise, q_buf.data(), d_buf.data(), ds_buf.data(),
                  is_buf.data());
  else
    TORCH_CHECK(false, "quant_linear: x must be float32 or bfloat16");
  Activations a{q_buf.data(), d_buf.data(), ds_buf.data(), is_buf.data(), K, nb};
#if defined(VLITE_AVX2)
  thread_local std::vector<int16_t> q16_buf;
  thread_local std::vector<float> d16_buf, ds16_buf;
  if ((fmt == 8 || (is_compact(fmt) && compact_weight_kind(fmt) != 4 && fmt != kQ2_K)) && precise) {
    if (static_cast<int64_t>(q16_buf.size()) < M * K) q16_buf.resize(M * K);
    if (static_cast<int64_t>(d16_buf.size()) < M * nb) { d16_buf.resize(M * nb); ds16_buf.resize(M * nb); }
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* qv = q_buf.data() + 2 * m * K;
      const int8_t* qr = qv + K;
      int16_t* o = q16_buf.data() + m * K;
      for (int64_t k = 0; k < K; ++k) o[k] = static_cast<int16_t>(256 * qv[k] + qr[k]);
      for (int64_t b = 0; b < nb; ++b) {
        d16_buf[m * nb + b] = d_buf[2 * m * nb + b] / 256.f;
        ds16_buf[m * nb + b] = ds_buf[2 * m * nb + b] + ds_buf[(2 * m + 1) * nb + b];
      }
    }
    a.q16 = q16_buf.data();
    a.d16 = d16_buf.data();
    a.dsum16 = ds16_buf.data();
  }
#endif
  const uint8_t* w = qt.data_ptr<uint8_t>();
  if (is_compact(fmt)) {
    const TileScales ts{fmt, reinterpret_cast<const uint8_t*>(st.data_ptr()),
                        static_cast<int64_t>(st.numel() * st.element_size() / st.size(0))};
    auto run = [&](auto out_tag) {
      using T = decltype(out_tag);
      T* o = reinterpret_cast<T*>(out.data_ptr());
      const T* rp = residual.has_value() ? reinterpret_cast<const T*>(residual->data_ptr()) : nullptr;
      const int kind = compact_weight_kind(fmt);
      if (kind == 4) gemm_impl<4, 32, float, T>(a, rows, w, nullptr, nullptr, N, o, precise, rp, &ts);
      else if (kind == 5) gemm_impl<5, 32, float, T>(a, rows, w, nullptr, nullptr, N, o, precise, rp, &ts);
      else if (kind == 6) gemm_impl<6, 16, float, T>(a, rows, w, nullptr, nullptr, N, o, precise, rp, &ts);
      else if (kind == 2) gemm_impl<2, 16, float, T>(a, rows, w, nullptr, nullptr, N, o, precise, rp, &ts);
      else if (kind == 3) gemm_impl<3, 16, float, T>(a, rows, w, nullptr, nullptr, N, o, precise, rp, &ts);
      else if (kind == 20) gemm_impl<20, 32, float, T>(a, rows, w, nullptr, nullptr, N, o, precise, rp, &ts);
      else gemm_impl<39, 32, float, T>(a, rows, w, nullptr, nullptr, N, o, precise, rp, &ts);
    };
    if (odt == at::kFloat) run(float());
    else run(c10::BFloat16());
    return out;
  }
  auto with_out = [&](auto out_tag, auto scale_tag) {
    using T = decltype(out_tag);
    using S = decltype(scale_tag);
    const S* sp = reinterpret_cast<const S*>(st.data_ptr());
    const S* mp = mt.has_value() ? reinterpret_cast<const S*>(mt->data_ptr()) : nullptr;
    T* o = reinterpret_cast<T*>(out.data_ptr());
    const T* rp = residual.has_value() ? reinterpret_cast<const T*>(residual->data_ptr()) : nullptr;
    if (fmt == 4) gemm_impl<4, 32, S, T>(a, rows, w, sp, mp, N, o, precise, rp);
    else if (sub == 32) gemm_impl<8, 32, S, T>(a, rows, w, sp, mp, N, o, precise, rp);
    else gemm_impl<8, 16, S, T>(a, rows, w, sp, mp, N, o, precise, rp);
  };
  auto with_scales = [&](auto out_tag) {
    if (st.scalar_type() == at::kHalf) with_out(out_tag, c10::Half());
    else with_out(out_tag, float());
  };
  if (odt == at::kFloat) with_scales(float());
  else with_scales(c10::BFloat16());
  return out;
}

// The dense [N, K] weight (dtype float32 or bfloat16) of a row-tiled packed weight: for steps large
// enough that a dense GEMM wins. `out`: a buffer to reuse (fresh pages of a new 7 MB tensor cost
// more than filling them).
// `rows` (int64 [R]): only those rows, in that order (an embedding lookup from the tied LM head's
// weights) -> [R, K].
at::Tensor dequantize(at::Tensor qt, at::Tensor st, c10::optional<at::Tensor> mt, int64_t fmt, int64_t sub, int64_t N,
                      at::ScalarType dtype, c10::optional<at::Tensor> out_buffer, c10::optional<at::Tensor> rows) {
  const int64_t kind = is_compact(fmt) ? compact_weight_kind(fmt) : fmt;
  const int64_t K = qt.size(1) * 8 / (kTile * (is_compact(fmt) ? compact_weight_bits(fmt) : fmt));  // bits per weight
  check_tiled(qt, st, mt, fmt, sub, N, K);
  at::Tensor idx;
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong, "dequantize: rows must be a 1-D int64 tensor");
    idx = rows->contiguous();
    const int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < idx.numel(); ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "dequantize: row ", ip[i], " out of range [0, ", N, ")");
  }
  const int64_t R = rows.has_value() ? idx.numel() : N;
  const int64_t* row_ids = rows.has_value() ? idx.data_ptr<int64_t>() : nullptr;
  at::Tensor out;
  if (out_buffer.has_value()) {
    out = *out_buffer;
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.dim() == 2 && out.size(0) == R &&
                out.size(1) == K, "dequantize: out must be a contiguous [rows, K] tensor of the requested dtype");
  } else {
    out = at::empty({R, K}, at::TensorOptions().dtype(dtype));
  }
  const uint8_t* w = qt.data_ptr<uint8_t>();
  const int64_t nb = K / QK, block_bytes = fmt == 4 ? kTile * QK / 2 : kTile * QK;
  if (is_compact(fmt)) {  // each row's tile scales decoded, its integers read as the portable kernel does
    const uint8_t* sp = reinterpret_cast<const uint8_t*>(st.data_ptr());
    const int64_t st_tile = st.numel() * st.element_size() / st.size(0), nsub = K / sub, tile_bytes = qt.size(1);
    auto run = [&](auto out_tag) {
      using T = decltype(out_tag);
      T* o = reinterpret_cast<T*>(out.data_ptr());
      at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> sc(nsub * kTile), mn(K / compact_min_sub(fmt) * kTile);
        int32_t vals[QK];
        int64_t decoded = -1;
        for (int64_t r = begin; r < end; ++r) {
          const int64_t n = row_ids != nullptr ? row_ids[r] : r;
          const int64_t t = n / kTile, l = n % kTile;
          if (t != decoded) decode_tile_scales(fmt, sp + t * st_tile, K, sc.data(), mn.data());
          decoded = t;
          const uint8_t* q = w + t * tile_bytes;
          for (int64_t b = 0; b < nb; ++b) {
            if (kind == 4) block_values<4>(q, nb, b, l, vals);
            else if (kind == 5) block_values<5>(q, nb, b, l, vals);
            else if (kind == 6) block_values<6>(q, nb, b, l, vals);
            else if (kind == 2) block_values<2>(q, nb, b, l, vals);
            else if (kind == 3) block_values<3>(q, nb, b, l, vals);
            else if (kind == 20) block_values<20>(q, nb, b, l, vals);
            else block_values<39>(q, nb, b, l, vals);
            const int64_t msub = compact_min_sub(fmt);
            T* ob = o + r * K + b * QK;
            for (int64_t i = 0; i < QK; ++i) {
              const float v = static_cast<float>(vals[i]) * sc[(b * QK / sub + i / sub) * kTile + l];
              ob[i] = static_cast<T>(compact_has_mins(fmt) ? v + mn[(b * QK / msub + i / msub) * kTile + l] : v);
            }
          }
        }
      });
    };
    if (dtype == at::kFloat) run(float());
    else if (dtype == at::kBFloat16) run(c10::BFloat16());
    else TORCH_CHECK(false, "dequantize: float32 or bfloat16 only");
    return out;
  }
  auto run = [&](auto out_tag, auto scale_tag) {
    using T = decltype(out_tag);
    using S = decltype(scale_tag);
    const S* sp = reinterpret_cast<const S*>(st.data_ptr());
    const S* mp = mt.has_value() ? reinterpret_cast<const S*>(mt->data_ptr()) : nullptr;
    T* o = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      float vals[QK];
      for (int64_t r = begin; r < end; ++r) {
        const int64_t n = row_ids != nullptr ? row_ids[r] : r;
        const int64_t t = n / kTile, l = n % kTile;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* wb = w + (t * nb + b) * block_bytes + 4 * l;
          if (fmt == 4) {  // chunk p: inputs 4p..4p+3 (low nibbles) and 16+4p.. (high)
            for (int p = 0; p < 4; ++p)
              for (int i = 0; i < 4; ++i) {
                vals[4 * p + i] = static_cast<float>(wb[64 * p + i] & 0x0F);
                vals[16 + 4 * p + i] = static_cast<float>(wb[64 * p + i] >> 4);
              }
          } else {
            for (int j = 0; j < 8; ++j)
              for (int i = 0; i < 4; ++i) vals[4 * j + i] = static_cast<float>(static_cast<int>(wb[64 * j + i]) - 128);
          }
          const float mn = mp != nullptr ? to_float(mp[(t * nb + b) * kTile + l]) : 0.f;
          T* ob = o + r * K + b * QK;
          for (int64_t h = 0; h < QK / sub; ++h) {  // one scale per sub-block: loops the compiler vectorizes
            const float sc = to_float(sp[(t * (K / sub) + b * (QK / sub) + h) * kTile + l]);
            if (mp != nullptr) {
              for (int64_t i = h * sub; i < (h + 1) * sub; ++i) ob[i] = static_cast<T>(vals[i] * sc + mn);
            } else {
              for (int64_t i = h * sub; i < (h + 1) * sub; ++i) ob[i] = static_cast<T>(vals[i] * sc);
            }
          }
        }
      }
    });
  };
  auto with_scales = [&](auto out_tag) {
    if (st.scalar_type() == at::kHalf) run(out_tag, c10::Half());
    else run(out_tag, float());
  };
  if (dtype == at::kFloat) with_scales(float());
  else if (dtype == at::kBFloat16) with_scales(c10::BFloat16());
  else TORCH_CHECK(false, "dequantize: float32 or bfloat16 only");
  return out;
}

int64_t tile_rows() { return kTile; }
int64_t precise_max_rows() { return kPreciseMaxRows; }

}  // namespace vlite

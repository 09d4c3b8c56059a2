// Linear layers over block-quantized weights (vlite/layers/packed.py has the layouts), the way
// llama.cpp computes them: activations are quantized on the fly to int8 in blocks of 32 (one
// float scale per block), each block's product is an integer dot product, and the block scales
// (and mins) are applied in float32:
//
//   y[m, n] = sum_b  sw[n, b] * dx[m, b] * (qw[n, b] . qx[m, b])  +  mw[n, b] * dx[m, b] * sum(qx[m, b])
//
// Integer dot products: AVX-512 VNNI `vpdpbusd` (u8 x s8 -> s32), else AVX2 `vpmaddubsw` +
// `vpmaddwd`; signed int8 weights go through the sign trick (|w| x sign(x, w)) so the u8 x s8
// products never saturate. The portable build computes the same sums in plain C++. Work is split
// over threads by output rows; a weight block is unpacked once and used for up to kRows activation
// rows (decode steps of a few requests read the weights once).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace vlite {

namespace {
constexpr int64_t QK = 32;
constexpr int kRows = 4;  // activation rows per weight-block unpack

// q4 activations are stored to match how a vector register unpacks the weights' nibbles: for a
// group of kGroup blocks, first the inputs 0..15 of each block, then their inputs 16..31
// (low nibbles, then high nibbles). Blocks after the last whole group stay in natural order.
#if defined(VLITE_AVX512)
constexpr int64_t kGroup = 4;
#elif defined(VLITE_AVX2)
constexpr int64_t kGroup = 2;
#else
constexpr int64_t kGroup = 1;
#endif

// where input i of block b lands in the q4 layout
inline int64_t q4_position(int64_t b, int64_t i, int64_t nb) {
  if (kGroup == 1 || b >= nb / kGroup * kGroup) return b * QK + i;
  const int64_t base = b / kGroup * kGroup * QK, slot = b % kGroup;
  return base + (i < 16 ? slot * 16 + i : kGroup * 16 + slot * 16 + (i - 16));
}

// ---- activations: x [M, K] -> int8 blocks of 32 with scale d = max|x| / 127 ----
// With a residual row (float32 activations: `precise`), x ~= d * (q + q_res / 256): the rounding
// error of the first int8 value, itself rounded to int8 at 1/256 of the step. The kernels treat
// it as one more activation row against the same unpacked weights (one extra integer dot product
// per block, no extra weight traffic), so products are ~16-bit accurate.
#if defined(VLITE_X86)
// 32 values -> int8 (in order) and their sum
static inline int32_t pack_block(__m256 t0, __m256 t1, __m256 t2, __m256 t3, int8_t* out) {
  __m256i i0 = _mm256_cvtps_epi32(t0), i1 = _mm256_cvtps_epi32(t1), i2 = _mm256_cvtps_epi32(t2),
          i3 = _mm256_cvtps_epi32(t3);
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  s4 = _mm_hadd_epi32(s4, s4);
  // packs work within 128-bit lanes; a permute restores the order
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), p);
  return _mm_cvtsi128_si32(s4);
}
#endif

static inline void store_block(int8_t* q, const int8_t* qb, int64_t b, int64_t nb, bool grouped) {
  if (grouped && kGroup > 1 && b < nb / kGroup * kGroup) {
    std::memcpy(q + q4_position(b, 0, nb), qb, 16);
    std::memcpy(q + q4_position(b, 16, nb), qb + 16, 16);
  } else {
    std::memcpy(q + b * QK, qb, QK);
  }
}

template <typename T>
void quantize_row(const T* x, int64_t K, bool grouped, int8_t* q, float* d, float* dsum, int8_t* qr, float* dr,
                  float* dsumr) {
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < nb; ++b) {
    const T* xb = x + b * QK;
    float xf[QK];
    int8_t qb[QK], rb[QK];
    int32_t total = 0, total_r = 0;
    for (int i = 0; i < QK; ++i) xf[i] = to_float(xb[i]);
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xf[i]));
    const float db = amax / 127.f;
    const float id = db > 0.f ? 127.f / amax : 0.f;
#if defined(VLITE_X86)
    const __m256 idv = _mm256_set1_ps(id);
    const int rm = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256 t[4], rt[4];
    for (int j = 0; j < 4; ++j) {
      t[j] = _mm256_mul_ps(_mm256_loadu_ps(xf + 8 * j), idv);
      rt[j] = _mm256_round_ps(t[j], rm);
    }
    total = pack_block(rt[0], rt[1], rt[2], rt[3], qb);
    if (qr != nullptr) {
      const __m256 k256 = _mm256_set1_ps(256.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
      __m256 e[4];
      for (int j = 0; j < 4; ++j)
        e[j] = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t[j], rt[j]), k256), rm)));
      total_r = pack_block(e[0], e[1], e[2], e[3], rb);
    }
#else
    for (int i = 0; i < QK; ++i) {
      const float t = xf[i] * id;
      const float r = std::nearbyint(t);
      qb[i] = static_cast<int8_t>(r);
      total += static_cast<int>(r);
      if (qr != nullptr) {
        const float e = std::min(127.f, std::max(-127.f, std::nearbyint((t - r) * 256.f)));
        rb[i] = static_cast<int8_t>(e);
        total_r += static_cast<int>(e);
      }
    }
#endif
    store_block(q, qb, b, nb, grouped);
    d[b] = db;
    dsum[b] = db * static_cast<float>(total);
    if (qr != nullptr) {
      store_block(qr, rb, b, nb, grouped);
      dr[b] = db / 256.f;
      dsumr[b] = dr[b] * static_cast<float>(total_r);
    }
  }
}

// rows of q/d/dsum: one per row of x, or two (value, residual) with `precise`
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, bool grouped, bool precise, int8_t* q, float* d, float* dsum) {
  const int64_t nb = K / QK, per = precise ? 2 : 1;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t o = m * per;
      quantize_row(x + m * K, K, grouped, q + o * K, d + o * nb, dsum + o * nb, precise ? q + (o + 1) * K : nullptr,
                   precise ? d + (o + 1) * nb : nullptr, precise ? dsum + (o + 1) * nb : nullptr);
    }
  });
}

#if defined(VLITE_X86)

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// sum of 4 adjacent u8 x s8 products per int32 lane
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
// the same for two pairs whose u8 values are at most 15 (q4: the int16 sums cannot overflow)
static inline __m256i dot2_u4s8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                           _mm256_set1_epi16(1));
#endif
}

#if defined(VLITE_AVX512)
static inline __m512i dot2_u4s8(__m512i u0, __m512i s0, __m512i u1, __m512i s1) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, s0), u1, s1);
#else
  return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(u0, s0), _mm512_maddubs_epi16(u1, s1)),
                           _mm512_set1_epi16(1));
#endif
}
static inline __m512i dot_s8s8(__m512i w, __m512i x) {  // |w| x (x with w's sign): no saturation
  const __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  const __m512i aw = _mm512_abs_epi8(w);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), _mm512_set1_epi16(1));
#endif
}
// 16 lanes: 4 consecutive lanes share one of 4 scales (blocks of q4, 16-input sub-blocks of q8)
static inline __m512 scales_x4(const float* d) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                               _mm512_castps128_ps512(_mm_loadu_ps(d)));
}
// 16 lanes: 8 consecutive lanes share one of 2 scales (32-input blocks of q8)
static inline __m512 scales_x8(const float* d) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                               _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d)))));
}
#endif

// 8 lanes: 4 consecutive lanes share one of 2 scales
static inline __m256 scales_x4_256(const float* d) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d)))),
                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// res[r] = sum over blocks of one weight row against R activation rows; d[r][.] = weight scale *
// activation scale per scale slot (one per block, or per 16 inputs when SUB == 16)
template <int FMT, int SUB, int R>
static inline void dot_row(const uint8_t* qs, int64_t nb, const int8_t* const* xq, const float* const* d,
                           float* res) {
  constexpr int64_t PER = QK / SUB;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
#if defined(VLITE_AVX512)
  __m512 acc5[R];
  for (int r = 0; r < R; ++r) acc5[r] = _mm512_setzero_ps();
  if constexpr (FMT == 4) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (; b + 4 <= nb; b += 4) {  // 4 blocks: 64 bytes of nibbles
      const __m512i raw = _mm512_loadu_si512(qs + b * 16);
      const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      for (int r = 0; r < R; ++r) {
        const __m512i xl = _mm512_loadu_si512(xq[r] + b * QK), xh = _mm512_loadu_si512(xq[r] + b * QK + 64);
        acc5[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2_u4s8(lo, xl, hi, xh)), scales_x4(d[r] + b), acc5[r]);
      }
    }
  } else {
    for (; b + 2 <= nb; b += 2) {  // 2 blocks of int8
      const __m512i w = _mm512_loadu_si512(qs + b * QK);
      for (int r = 0; r < R; ++r) {
        const __m512 sv = SUB == 32 ? scales_x8(d[r] + b) : scales_x4(d[r] + b * PER);
        acc5[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_s8s8(w, _mm512_loadu_si512(xq[r] + b * QK))), sv, acc5[r]);
      }
    }
  }
#else
  if constexpr (FMT == 4) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (; b + 2 <= nb; b += 2) {  // 2 blocks: 32 bytes of nibbles
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * 16));
      const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      for (int r = 0; r < R; ++r) {
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * QK));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * QK + 32));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2_u4s8(lo, xl, hi, xh)), scales_x4_256(d[r] + b), acc[r]);
      }
    }
  }
#endif
  for (; b < nb; ++b) {  // single blocks, natural order
    __m256i w;
    if constexpr (FMT == 4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
      w = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1),
                           _mm256_set1_epi8(0x0F));
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * QK));
    }
    const __m256i aw = FMT == 4 ? w : _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * QK));
      if constexpr (FMT == 8) x = _mm256_sign_epi8(x, w);
      const __m256 sv = SUB == 32 ? _mm256_broadcast_ss(d[r] + b) : scales_x4_256(d[r] + b * PER);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(aw, x)), sv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    res[r] = hsum8(acc[r]);
#if defined(VLITE_AVX512)
    res[r] += _mm512_reduce_add_ps(acc5[r]);
#endif
  }
}

// per weight row: d_r[j] = sw[j] * xd_r[block of j] for each activation row, and the mins term
template <int SUB, typename S>
static inline void row_scales(const S* sw, const S* mw, int64_t nb, const float* xd, const float* xds, int R,
                              float* dd, float* mins_term) {
  constexpr int64_t PER = QK / SUB;
  for (int r = 0; r < R; ++r) {
    const float* xdr = xd + r * nb;
    float* ddr = dd + r * nb * PER;
    int64_t j = 0;
    for (; j + 8 <= nb * PER; j += 8) {
      __m256 xv;
      if constexpr (PER == 1) xv = _mm256_loadu_ps(xdr + j);
      else xv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(xdr + j / 2)),
                                         _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
      _mm256_storeu_ps(ddr + j, _mm256_mul_ps(load8(sw + j), xv));
    }
    for (; j < nb * PER; ++j) ddr[j] = to_float(sw[j]) * xdr[j / PER];
    if (mw != nullptr) {
      const float* xsr = xds + r * nb;
      __m256 acc = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(load8(mw + b), _mm256_loadu_ps(xsr + b), acc);
      float s = hsum8(acc);
      for (; b < nb; ++b) s += to_float(mw[b]) * xsr[b];
      mins_term[r] = s;
    } else {
      mins_term[r] = 0.f;
    }
  }
}
#else
template <int FMT, int SUB, int R>
static inline void dot_row(const uint8_t* qs, int64_t nb, const int8_t* const* xq, const float* const* d,
                           float* res) {
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int8_t w[QK];
    if constexpr (FMT == 4) {
      for (int i = 0; i < 16; ++i) {
        w[i] = static_cast<int8_t>(qs[b * 16 + i] & 0x0F);
        w[i + 16] = static_cast<int8_t>(qs[b * 16 + i] >> 4);
      }
    } else {
      for (int i = 0; i < QK; ++i) w[i] = static_cast<int8_t>(qs[b * QK + i]);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq[r] + b * QK;
      for (int h = 0; h < QK / SUB; ++h) {
        int32_t s = 0;
        for (int i = h * SUB; i < (h + 1) * SUB; ++i) s += static_cast<int32_t>(w[i]) * x[i];
        acc[r] += d[r][b * (QK / SUB) + h] * static_cast<float>(s);
      }
    }
  }
  for (int r = 0; r < R; ++r) res[r] = acc[r];
}

template <int SUB, typename S>
static inline void row_scales(const S* sw, const S* mw, int64_t nb, const float* xd, const float* xds, int R,
                              float* dd, float* mins_term) {
  constexpr int64_t PER = QK / SUB;
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < nb * PER; ++j) dd[r * nb * PER + j] = to_float(sw[j]) * xd[r * nb + j / PER];
    float s = 0.f;
    if (mw != nullptr)
      for (int64_t b = 0; b < nb; ++b) s += to_float(mw[b]) * xds[r * nb + b];
    mins_term[r] = s;
  }
}
#endif

template <typename S>
static inline void load_floats(const S* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(VLITE_X86)
  if constexpr (std::is_same_v<S, c10::Half>) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  } else if constexpr (std::is_same_v<S, float>) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

template <int FMT, int SUB, int R, typename S>
static inline void tile(const uint8_t* qs, int64_t nb, const S* sw, const S* mw, const int8_t* xq, const float* xd,
                        const float* xds, int64_t m0, float* dd, float* res) {
  constexpr int64_t PER = QK / SUB;
  const int8_t* xr[R];
  const float* dr[R];
  float mins_term[R];
  row_scales<SUB>(sw, mw, nb, xd + m0 * nb, xds + m0 * nb, R, dd, mins_term);
  for (int r = 0; r < R; ++r) {
    xr[r] = xq + (m0 + r) * nb * QK;
    dr[r] = dd + r * nb * PER;
  }
  dot_row<FMT, SUB, R>(qs, nb, xr, dr, res);
  for (int r = 0; r < R; ++r) res[r] += mins_term[r];
}

// M activation rows (2 per output row with `pairs`: value and residual, summed) x N weight rows
template <int FMT, int SUB, typename S, typename T>
void gemm_impl(const int8_t* xq, const float* xd, const float* xds, int64_t M, int64_t K, const uint8_t* qs,
               const S* scales, const S* mins, int64_t N, T* out, bool pairs) {
  const int64_t nb = K / QK;
  const int64_t row_bytes = FMT == 4 ? K / 2 : K;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, M * nb));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> dd(kRows * (K / SUB)), swf(K / SUB), mwf(nb);
    float res[kRows];
    for (int64_t n = begin; n < end; ++n) {
      // this row's scales (and mins) as float32, once for all its activation tiles
      load_floats(scales + n * (K / SUB), K / SUB, swf.data());
      if (mins != nullptr) load_floats(mins + n * nb, nb, mwf.data());
      const float* sw = swf.data();
      const float* mw = mins != nullptr ? mwf.data() : nullptr;
      const uint8_t* q = qs + n * row_bytes;
      int64_t m = 0;
      auto emit = [&](int64_t rows) {
        if (pairs) {
          for (int64_t r = 0; r + 1 < rows; r += 2) out[((m + r) / 2) * N + n] = static_cast<T>(res[r] + res[r + 1]);
        } else {
          for (int64_t r = 0; r < rows; ++r) out[(m + r) * N + n] = static_cast<T>(res[r]);
        }
      };
      for (; m + kRows <= M; m += kRows) {
        tile<FMT, SUB, kRows>(q, nb, sw, mw, xq, xd, xds, m, dd.data(), res);
        emit(kRows);
      }
      switch (M - m) {
        case 3: tile<FMT, SUB, 3>(q, nb, sw, mw, xq, xd, xds, m, dd.data(), res); break;
        case 2: tile<FMT, SUB, 2>(q, nb, sw, mw, xq, xd, xds, m, dd.data(), res); break;
        case 1: tile<FMT, SUB, 1>(q, nb, sw, mw, xq, xd, xds, m, dd.data(), res); break;
        default: break;
      }
      emit(M - m);
    }
  });
}

void check_packed(const torch::Tensor& qs, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                  int64_t fmt, int64_t sub, int64_t K) {
  TORCH_CHECK(fmt == 4 || fmt == 8, "fmt must be 4 or 8");
  TORCH_CHECK(sub == 32 || (sub == 16 && fmt == 8), "sub must be 32 (or 16 for q8)");
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == (fmt == 4 ? K / 2 : K), "bad qs");
  TORCH_CHECK(qs.scalar_type() == (fmt == 4 ? at::kByte : at::kChar), "qs must be uint8 (q4) or int8 (q8)");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == qs.size(0) && scales.size(1) == K / sub,
              "bad scales");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat, "scales: float16 or float32");
  if (mins.has_value()) {
    TORCH_CHECK(mins->is_contiguous() && mins->dim() == 2 && mins->size(0) == qs.size(0) && mins->size(1) == K / QK,
                "bad mins");
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type(), "mins and scales must share a dtype");
  }
}
}  // namespace

// x [M, K] float32/bf16 -> (int8 [R, K], float32 d [R, K/32], float32 d * sum(q) [R, K/32]), R = M,
// or 2M with `precise` (rows 2m, 2m+1: value and residual of x[m]); grouped: the int8 values in the
// q4 kernels' order (q4_position), else in natural order
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, bool grouped, bool precise) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % QK == 0, "x must be [M, K] with K a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), R = precise ? 2 * M : M;
  auto q = torch::empty({R, K}, torch::kInt8);
  auto d = torch::empty({R, K / QK}, torch::kFloat);
  auto ds = torch::empty({R, K / QK}, torch::kFloat);
  if (xc.scalar_type() == at::kFloat)
    quantize_rows(xc.data_ptr<float>(), M, K, grouped, precise, q.data_ptr<int8_t>(), d.data_ptr<float>(), ds.data_ptr<float>());
  else if (xc.scalar_type() == at::kBFloat16)
    quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K, grouped, precise, q.data_ptr<int8_t>(), d.data_ptr<float>(), ds.data_ptr<float>());
  else
    TORCH_CHECK(false, "quantize_activations: float32 or bfloat16 only");
  return {q, d, ds};
}

// y [M, N] (x's dtype) = x [M, K] @ dequant(W).T for a packed weight (fmt 4: q4, 8: q8); float32
// activations get a residual row each (~16-bit products), bf16 ones a single int8 row
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                           int64_t fmt, int64_t sub) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  check_packed(qs, scales, mins, fmt, sub, K);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const bool precise = x.scalar_type() == at::kFloat;
  auto xq = quantize_activations(x, fmt == 4, precise);
  const int64_t rows = xq[0].size(0);
  const int8_t* q = xq[0].data_ptr<int8_t>();
  const float* d = xq[1].data_ptr<float>();
  const float* ds = xq[2].data_ptr<float>();
  const uint8_t* w = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  auto with_out = [&](auto out_tag, auto scale_tag) {
    using T = decltype(out_tag);
    using S = decltype(scale_tag);
    const S* sp = reinterpret_cast<const S*>(scales.data_ptr());
    const S* mp = mins.has_value() ? reinterpret_cast<const S*>(mins->data_ptr()) : nullptr;
    T* o = reinterpret_cast<T*>(out.data_ptr());
    if (fmt == 4) gemm_impl<4, 32, S, T>(q, d, ds, rows, K, w, sp, mp, N, o, precise);
    else if (sub == 32) gemm_impl<8, 32, S, T>(q, d, ds, rows, K, w, sp, mp, N, o, precise);
    else gemm_impl<8, 16, S, T>(q, d, ds, rows, K, w, sp, mp, N, o, precise);
  };
  auto with_scales = [&](auto out_tag) {
    if (scales.scalar_type() == at::kHalf) with_out(out_tag, c10::Half());
    else with_out(out_tag, float());
  };
  if (x.scalar_type() == at::kFloat) with_scales(float());
  else if (x.scalar_type() == at::kBFloat16) with_scales(c10::BFloat16());
  else TORCH_CHECK(false, "quant_linear: x must be float32 or bfloat16");
  return out;
}

// The dense [N, K] weight (dtype float32 or bfloat16): for steps large enough that a dense GEMM wins.
// `out`: a buffer to reuse (fresh pages of a new 7 MB tensor cost more than filling them).
torch::Tensor dequantize(torch::Tensor qs, torch::Tensor scales, c10::optional<torch::Tensor> mins, int64_t fmt,
                         int64_t sub, at::ScalarType dtype, c10::optional<torch::Tensor> out_buffer) {
  const int64_t N = qs.size(0), K = fmt == 4 ? qs.size(1) * 2 : qs.size(1);
  check_packed(qs, scales, mins, fmt, sub, K);
  torch::Tensor out;
  if (out_buffer.has_value()) {
    out = *out_buffer;
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.dim() == 2 && out.size(0) == N &&
                out.size(1) == K, "dequantize: out must be a contiguous [N, K] tensor of the requested dtype");
  } else {
    out = torch::empty({N, K}, torch::TensorOptions().dtype(dtype));
  }
  const uint8_t* w = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  auto run = [&](auto out_tag, auto scale_tag) {
    using T = decltype(out_tag);
    using S = decltype(scale_tag);
    const S* sp = reinterpret_cast<const S*>(scales.data_ptr());
    const S* mp = mins.has_value() ? reinterpret_cast<const S*>(mins->data_ptr()) : nullptr;
    T* o = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      float vals[QK];
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t b = 0; b < K / QK; ++b) {
#if defined(VLITE_X86)
          if constexpr (std::is_same_v<T, float>) {  // 32 values: widen to int32, scale (+ min), store
            const __m256i q8 = fmt == 4 ? [&] {
              const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * (K / 2) + b * 16));
              return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1),
                                      _mm256_set1_epi8(0x0F));
            }() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + b * QK));
            const __m256 mn = _mm256_set1_ps(mp != nullptr ? to_float(mp[n * (K / QK) + b]) : 0.f);
            float* ob = reinterpret_cast<float*>(o) + n * K + b * QK;
            for (int j = 0; j < 4; ++j) {
              const __m128i part = j < 2 ? _mm256_castsi256_si128(q8) : _mm256_extracti128_si256(q8, 1);
              const __m128i bytes = (j % 2 == 0) ? part : _mm_srli_si128(part, 8);
              const __m256i i32 = fmt == 4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
              const __m256 sc = _mm256_set1_ps(to_float(sp[n * (K / sub) + (b * QK + 8 * j) / sub]));
              _mm256_storeu_ps(ob + 8 * j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i32), sc), mn));
            }
            continue;
          }
#endif
          if (fmt == 4) {
            const uint8_t* qb = w + n * (K / 2) + b * 16;
            for (int i = 0; i < 16; ++i) { vals[i] = qb[i] & 0x0F; vals[i + 16] = qb[i] >> 4; }
          } else {
            const int8_t* qb = reinterpret_cast<const int8_t*>(w) + n * K + b * QK;
            for (int i = 0; i < QK; ++i) vals[i] = qb[i];
          }
          const float mn = mp != nullptr ? to_float(mp[n * (K / QK) + b]) : 0.f;
          T* ob = o + n * K + b * QK;
          for (int64_t h = 0; h < QK / sub; ++h) {  // one scale per sub-block: loops the compiler vectorizes
            const float sc = to_float(sp[n * (K / sub) + b * (QK / sub) + h]);
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
    if (scales.scalar_type() == at::kHalf) run(out_tag, c10::Half());
    else run(out_tag, float());
  };
  if (dtype == at::kFloat) with_scales(float());
  else if (dtype == at::kBFloat16) with_scales(c10::BFloat16());
  else TORCH_CHECK(false, "dequantize: float32 or bfloat16 only");
  return out;
}

}  // namespace vlite

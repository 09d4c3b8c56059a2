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
template <typename T>
void quantize_row(const T* x, int64_t K, bool grouped, int8_t* q, float* d, float* dsum) {
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < nb; ++b) {
    const T* xb = x + b * QK;
    float xf[QK];
    int8_t qb[QK];
    for (int i = 0; i < QK; ++i) xf[i] = to_float(xb[i]);
#if defined(VLITE_X86)
    __m256 v0 = _mm256_loadu_ps(xf), v1 = _mm256_loadu_ps(xf + 8), v2 = _mm256_loadu_ps(xf + 16),
           v3 = _mm256_loadu_ps(xf + 24);
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.f;
    const __m256 id = _mm256_set1_ps(db > 0.f ? 127.f / amax : 0.f);
    const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, id), r));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, id), r));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, id), r));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, id), r));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    const int32_t total = _mm_cvtsi128_si32(s4);
    // pack 4 x 8 int32 -> 32 int8 in order (packs work within 128-bit lanes; fix with a permute)
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p);
#else
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xf[i]));
    const float db = amax / 127.f;
    const float id = db > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    for (int i = 0; i < QK; ++i) {
      const int v = static_cast<int>(std::nearbyint(xf[i] * id));
      qb[i] = static_cast<int8_t>(v);
      total += v;
    }
#endif
    if (grouped && kGroup > 1 && b < nb / kGroup * kGroup) {
      std::memcpy(q + q4_position(b, 0, nb), qb, 16);
      std::memcpy(q + q4_position(b, 16, nb), qb + 16, 16);
    } else {
      std::memcpy(q + b * QK, qb, QK);
    }
    d[b] = db;
    dsum[b] = db * static_cast<float>(total);
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, bool grouped, int8_t* q, float* d, float* dsum) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * K, K, grouped, q + m * K, d + m * (K / QK), dsum + m * (K / QK));
  });
}

#if defined(VLITE_X86)
static inline float hsum8_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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
    res[r] = hsum8_ps(acc[r]);
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
      float s = hsum8_ps(acc);
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

template <int FMT, int SUB, typename S, typename T>
void gemm_impl(const int8_t* xq, const float* xd, const float* xds, int64_t M, int64_t K, const uint8_t* qs,
               const S* scales, const S* mins, int64_t N, T* out) {
  const int64_t nb = K / QK;
  const int64_t row_bytes = FMT == 4 ? K / 2 : K;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, M * nb));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> dd(kRows * (K / SUB));
    float res[kRows];
    for (int64_t n = begin; n < end; ++n) {
      const S* sw = scales + n * (K / SUB);
      const S* mw = mins != nullptr ? mins + n * nb : nullptr;
      const uint8_t* q = qs + n * row_bytes;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows) {
        tile<FMT, SUB, kRows>(q, nb, sw, mw, xq, xd, xds, m, dd.data(), res);
        for (int r = 0; r < kRows; ++r) out[(m + r) * N + n] = static_cast<T>(res[r]);
      }
      switch (M - m) {
        case 3: tile<FMT, SUB, 3>(q, nb, sw, mw, xq, xd, xds, m, dd.data(), res); break;
        case 2: tile<FMT, SUB, 2>(q, nb, sw, mw, xq, xd, xds, m, dd.data(), res); break;
        case 1: tile<FMT, SUB, 1>(q, nb, sw, mw, xq, xd, xds, m, dd.data(), res); break;
        default: break;
      }
      for (int64_t r = 0; r < M - m; ++r) out[(m + r) * N + n] = static_cast<T>(res[r]);
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

// x [M, K] float32/bf16 -> (int8 [M, K], float32 d [M, K/32], float32 d * sum(q) [M, K/32]);
// grouped: the int8 values in the q4 kernels' order (q4_position), else in natural order
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, bool grouped) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % QK == 0, "x must be [M, K] with K a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto q = torch::empty({M, K}, torch::kInt8);
  auto d = torch::empty({M, K / QK}, torch::kFloat);
  auto ds = torch::empty({M, K / QK}, torch::kFloat);
  if (xc.scalar_type() == at::kFloat)
    quantize_rows(xc.data_ptr<float>(), M, K, grouped, q.data_ptr<int8_t>(), d.data_ptr<float>(), ds.data_ptr<float>());
  else if (xc.scalar_type() == at::kBFloat16)
    quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K, grouped, q.data_ptr<int8_t>(), d.data_ptr<float>(), ds.data_ptr<float>());
  else
    TORCH_CHECK(false, "quantize_activations: float32 or bfloat16 only");
  return {q, d, ds};
}

// y [M, N] (x's dtype) = x [M, K] @ dequant(W).T for a packed weight (fmt 4: q4, 8: q8)
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                           int64_t fmt, int64_t sub) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  check_packed(qs, scales, mins, fmt, sub, K);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  auto xq = quantize_activations(x, fmt == 4);
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
    if (fmt == 4) gemm_impl<4, 32, S, T>(q, d, ds, M, K, w, sp, mp, N, o);
    else if (sub == 32) gemm_impl<8, 32, S, T>(q, d, ds, M, K, w, sp, mp, N, o);
    else gemm_impl<8, 16, S, T>(q, d, ds, M, K, w, sp, mp, N, o);
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
torch::Tensor dequantize(torch::Tensor qs, torch::Tensor scales, c10::optional<torch::Tensor> mins, int64_t fmt,
                         int64_t sub, at::ScalarType dtype) {
  const int64_t N = qs.size(0), K = fmt == 4 ? qs.size(1) * 2 : qs.size(1);
  check_packed(qs, scales, mins, fmt, sub, K);
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(dtype));
  const uint8_t* w = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  auto run = [&](auto out_tag, auto scale_tag) {
    using T = decltype(out_tag);
    using S = decltype(scale_tag);
    const S* sp = reinterpret_cast<const S*>(scales.data_ptr());
    const S* mp = mins.has_value() ? reinterpret_cast<const S*>(mins->data_ptr()) : nullptr;
    T* o = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t b = 0; b < K / QK; ++b) {
          float* rb = row.data() + b * QK;
          if (fmt == 4) {
            const uint8_t* qb = w + n * (K / 2) + b * 16;
            for (int i = 0; i < 16; ++i) { rb[i] = qb[i] & 0x0F; rb[i + 16] = qb[i] >> 4; }
          } else {
            const int8_t* qb = reinterpret_cast<const int8_t*>(w) + n * K + b * QK;
            for (int i = 0; i < QK; ++i) rb[i] = qb[i];
          }
          for (int i = 0; i < QK; ++i) rb[i] *= to_float(sp[n * (K / sub) + (b * QK + i) / sub]);
          if (mp != nullptr) {
            const float mn = to_float(mp[n * (K / QK) + b]);
            for (int i = 0; i < QK; ++i) rb[i] += mn;
          }
        }
        T* orow = o + n * K;
        for (int64_t k = 0; k < K; ++k) orow[k] = static_cast<T>(row[k]);
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

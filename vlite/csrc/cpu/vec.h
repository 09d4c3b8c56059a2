// Sixteen float lanes over whatever the build's ISA has: one AVX-512 register, two AVX2 registers,
// or a plain array the compiler vectorizes as it can (the portable build, any CPU).
// Every kernel in this folder is written once against these helpers and compiled once per ISA.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace vlite {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VLITE_ISA_NAME "avx512"
#define VLITE_AVX512 1
#define VLITE_X86 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VLITE_ISA_NAME "avx2"
#define VLITE_AVX2 1
#define VLITE_X86 1
#else
#define VLITE_ISA_NAME "portable"
#endif

// at::parallel_for grain for row-wise work: rows per thread at least a few thousand values, so that
// the rows of a speculative verify step (or a small decode batch) split over the threads instead of
// running on one while the others wait.
inline int64_t row_grain(int64_t values_per_row) { return std::max<int64_t>(1, 4096 / values_per_row); }

// f(integral_constant<int, v>) for a run-time 1 <= v <= N: block sizes as template arguments keep a
// kernel's accumulators in registers (dense_linear.cpp, lora.cpp)
template <int N, typename F>
inline void with_count(int64_t v, F&& f) {
  if constexpr (N > 1) {
    if (v < N) return with_count<N - 1>(v, f);
  }
  f(std::integral_constant<int, N>());
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

#if defined(VLITE_X86)
// sum of the 8 lanes (both x86 builds: the AVX-512 one also works in 256-bit registers)
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(VLITE_AVX512)
struct Vec16 {
  __m512 v;
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load(const c10::BFloat16* p) {
    __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
};
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
// exp for x <= 0 (softmax after subtracting the max): 2^k * p(r), |rel err| ~1e-7
inline Vec16 vexp(Vec16 a) {
  __m512 x = _mm512_max_ps(a.v, _mm512_set1_ps(-87.3f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return {_mm512_scalef_ps(p, k)};
}
inline Vec16 vabs(Vec16 a) { return {_mm512_abs_ps(a.v)}; }
// where g >= 0: a, else b
inline Vec16 select_ge0(Vec16 g, Vec16 a, Vec16 b) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(g.v, _mm512_setzero_ps(), _CMP_GE_OQ), b.v, a.v)};
}
#elif defined(VLITE_AVX2)
static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline __m256 load_bf16x8(const c10::BFloat16* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
struct Vec16 {
  __m256 lo, hi;
  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec16 load(const c10::BFloat16* p) { return {load_bf16x8(p), load_bf16x8(p + 8)}; }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  float sum() const { return hsum8(_mm256_add_ps(lo, hi)); }
  float max() const { return hmax8(_mm256_max_ps(lo, hi)); }
};
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^k through the exponent bits (k >= -126 after the clamp: a normal float)
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline Vec16 vexp(Vec16 a) { return {exp8(a.lo), exp8(a.hi)}; }
inline Vec16 vabs(Vec16 a) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
inline Vec16 select_ge0(Vec16 g, Vec16 a, Vec16 b) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(g.lo, z, _CMP_GE_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(g.hi, z, _CMP_GE_OQ))};
}
#else
struct Vec16 {
  float v[16];
  static Vec16 zero() { return set1(0.f); }
  static Vec16 set1(float x) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
  template <typename T>
  static Vec16 load(const T* p) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = to_float(p[i]); return r; }
  void store(float* p) const { for (int i = 0; i < 16; ++i) p[i] = v[i]; }
  float sum() const { float s = 0.f; for (int i = 0; i < 16; ++i) s += v[i]; return s; }
  float max() const { float m = v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, v[i]); return m; }
};
#define VLITE_VEC16_BINARY(name, expr) \
  inline Vec16 name(Vec16 a, Vec16 b) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = (expr); return r; }
VLITE_VEC16_BINARY(operator+, a.v[i] + b.v[i])
VLITE_VEC16_BINARY(operator-, a.v[i] - b.v[i])
VLITE_VEC16_BINARY(operator*, a.v[i] * b.v[i])
VLITE_VEC16_BINARY(operator/, a.v[i] / b.v[i])
VLITE_VEC16_BINARY(vmax, std::max(a.v[i], b.v[i]))
#undef VLITE_VEC16_BINARY
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
  Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r;
}
inline Vec16 vexp(Vec16 a) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::exp(a.v[i]); return r; }
inline Vec16 vabs(Vec16 a) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::fabs(a.v[i]); return r; }
inline Vec16 select_ge0(Vec16 g, Vec16 a, Vec16 b) {
  Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = g.v[i] >= 0.f ? a.v[i] : b.v[i]; return r;
}
#endif

// out[k] = sum of row k of a 16 x 16 row-major float matrix: 16 horizontal sums at the cost of
// ~40 shuffles and adds instead of ~130 (the attention scores of 16 keys at once)
#if defined(VLITE_AVX512)
inline Vec16 reduce16(const float* rows) {
  __m512 x[8], y[4];
  for (int k = 0; k < 8; ++k) {  // quarters: [r_k q0+q2, r_k q1+q3, r_k+8 q0+q2, r_k+8 q1+q3]
    const __m512 a = _mm512_loadu_ps(rows + 16 * k), b = _mm512_loadu_ps(rows + 16 * (k + 8));
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = 0; k < 4; ++k)  // quarters: 4 partial sums of r_k, r_k+8, r_k+4, r_k+12
    y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[k], x[k + 4], 0x88), _mm512_shuffle_f32x4(x[k], x[k + 4], 0xDD));
  const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 v = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u, v, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(u, v, _MM_SHUFFLE(3, 2, 3, 2)));
  return {_mm512_shuffle_f32x4(w, w, 0xD8)};  // [r0-3, r8-11, r4-7, r12-15] -> in order
}
#elif defined(VLITE_AVX2)
// 8 lanes of eight vectors -> their 8 sums
static inline __m256 reduce8x8(const __m256* a) {
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}
inline Vec16 reduce16(const float* rows) {
  __m256 s[16];
  for (int k = 0; k < 16; ++k) s[k] = _mm256_add_ps(_mm256_loadu_ps(rows + 16 * k), _mm256_loadu_ps(rows + 16 * k + 8));
  return {reduce8x8(s), reduce8x8(s + 8)};
}
#else
inline Vec16 reduce16(const float* rows) {
  Vec16 r;
  for (int k = 0; k < 16; ++k) {
    float t = 0.f;
    for (int l = 0; l < 16; ++l) t += rows[16 * k + l];
    r.v[k] = t;
  }
  return r;
}
#endif

// store 16 lanes as T (float, or bf16 rounded to nearest even, NaN as 0x7FC0: c10::BFloat16's rule,
// in integer vector operations; one scalar conversion per value made bf16 steps of a few rows spend
// more time storing the linears' outputs than computing them)
inline void store16(float* p, Vec16 v) { v.store(p); }
#if defined(VLITE_AVX512)
inline void store16(c10::BFloat16* p, Vec16 v) {
  const __m512i b = _mm512_castps_si512(v.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v.v, v.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#elif defined(VLITE_AVX2)
static inline __m128i bf16x8(__m256 f) {
  const __m256i b = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // values <= 0xFFFF: exact
}
inline void store16(c10::BFloat16* p, Vec16 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16x8(v.lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), bf16x8(v.hi));
}
#else
inline void store16(c10::BFloat16* p, Vec16 v) {
  float tmp[16];
  v.store(tmp);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::BFloat16>(tmp[i]);
}
#endif

}  // namespace vlite

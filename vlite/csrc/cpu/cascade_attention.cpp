// Cascade attention for decode rows (issue 47): when every row of a step starts with the same KV blocks
// (a system prompt or document shared through the prefix cache), the prefix is attended once for all
// rows, as a matrix product, and each row's own keys after it as usual; the two parts merge exactly
// through their log-sum-exp:
//
//   prefix  for each (kv head h, chunk of kChunk prefix keys, group of query vectors), in parallel:
//             the chunk's keys are laid out once with keys in vector lanes (16 keys per register), then
//             every query vector of the group (rows x the head's G query heads) gets 16 scores per
//             register with no horizontal sums, a softmax over the chunk, and P.V: its running max m,
//             sum l and unnormalized output acc
//   suffix  decode_attention_fast from key P * block_size on (float32 out, with each head's lse)
//   merge   per query head: o = (sum_c e^(m_c - M) acc_c + e^(lse_s - M) o_s) / (sum_c e^(m_c - M) l_c + e^(lse_s - M))
//           (+ e^(sink - M) in the denominator where the model has attention sinks)
//
// The plain kernel reads the prefix once per row: ~1.5 MB a layer at 2,000 tokens for the default model,
// held in L2/L3 after the first row, so its cost is the arithmetic (scores as per-key dot products with
// a horizontal sum per 16 keys). Here each chunk's layout change is paid once for all rows, and the
// scores and P.V are register-blocked over several query vectors. bf16 caches on AVX512_BF16: vdpbf16ps
// on key pairs (scores) and value pairs (P.V, probabilities rounded to bf16, as pv_bf16); otherwise
// float32 FMAs on converted rows. The sums' order differs from the plain kernel's: a row's output is
// the same attention up to rounding, not the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vec.h"

// Included by bindings.cpp after decode_attention.cpp (decode_attention_fast) and attention_chunk.cpp
// (softmax_numerators, kBf16Dot), whose helpers this file uses.
namespace vlite {

namespace {
constexpr int64_t kChunk = 256;    // prefix keys per unit (K and V of a chunk stay in L2)
constexpr int64_t kVectors = 96;   // query vectors per unit (rows x query heads of one kv head)

// Register blocking of the float32 path (a Vec16: one zmm, two ymm): scores for kScoreVecs query vectors
// per pass over 16 keys (independent FMA chains), P.V over slices of kSliceVecs Vec16 of a value row for
// kPvVecs query vectors (the accumulators: kSliceVecs x kPvVecs Vec16 of the 32 zmm / 16 ymm).
#if defined(VLITE_AVX512)
constexpr int kScoreVecs = 8, kSliceVecs = 4, kPvVecs = 4;
#elif defined(VLITE_AVX2)
constexpr int kScoreVecs = 4, kSliceVecs = 2, kPvVecs = 3;
#else
constexpr int kScoreVecs = 4, kSliceVecs = 4, kPvVecs = 1;
#endif

// A unit's outputs: query vector r of the unit (its r-th of R) writes its max m[r], sum l[r] and
// unnormalized output acc[r * D].
struct UnitOut {
  float *m, *l, *acc;
};

// The chunk's key rows [j0, j0 + len) of one kv head's cache through the prefix's block ids.
template <typename T>
inline const T* key_row(const T* cache, const int64_t* blocks, int64_t BS, int64_t D, int64_t j) {
  return cache + (blocks[j / BS] * BS + j % BS) * D;
}

// One vector's chunk of scores (16-padded to len16) -> softmax numerators over its first `visible` keys,
// zeros after them; its max and sum (-inf and 0 where it sees none of the chunk).
static inline void chunk_softmax(float* sr, int64_t len, int64_t visible, float* m, float* l) {
  const int64_t len16 = (len + 15) / 16 * 16, vis = std::min(visible, len);
  if (vis <= 0) {
    std::fill(sr, sr + len16, 0.f);
    *m = -INFINITY;
    *l = 0.f;
    return;
  }
  softmax_numerators(sr, vis, m, l);
  std::fill(sr + (vis + 15) / 16 * 16, sr + len16, 0.f);
}

#if defined(VLITE_AVX512)
// r[k] (row k of a 16 x 16 matrix of 32-bit values) -> r[c] = column c: 32-bit then 64-bit unpacks within
// 128-bit lanes (r[4i + m], lane L: column 4L + m of rows 4i..4i+3), then a 4 x 4 transpose of those lanes.
static inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[m], u[4 + m], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i s1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i s2 = _mm512_shuffle_i32x4(u[m], u[4 + m], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(3, 2, 3, 2));
    r[m] = _mm512_shuffle_i32x4(s0, s1, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + m] = _mm512_shuffle_i32x4(s0, s1, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + m] = _mm512_shuffle_i32x4(s2, s3, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + m] = _mm512_shuffle_i32x4(s2, s3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}
#endif

// Query vectors [r0, r0 + R) of kv head h (vector r: row r / G, query head h * G + r % G of q [rows, H, D])
// against the keys [j0, j0 + len) of kh / vh through `blocks`: a softmax over the chunk and P.V. Causal
// (`vis0` < len): vector r sees the chunk's first vis0 + r / G keys (none if that is <= 0: m = -inf, l = 0).
template <int NV, typename T>
void prefix_unit(const T* q, int64_t H, int64_t G, const T* kh, const T* vh, const int64_t* blocks, int64_t BS,
                 int64_t j0, int64_t len, int64_t r0, int64_t R, int64_t h, float scale, int64_t vis0,
                 const UnitOut& uo) {
  constexpr int64_t D = NV * 16;
  const int64_t len16 = (len + 15) / 16 * 16, ls = len16;
  thread_local std::vector<float> s, kf, vf, qf;
  s.resize(R * ls);
  auto qrow = [&](int64_t r) { return q + ((r0 + r) / G * H + h * G + (r0 + r) % G) * D; };
#if defined(VLITE_AVX512) && defined(__AVX512BF16__)
  if constexpr (kBf16Dot<T>) {
    // keys: [16-key group][D/2 pairs of dims][16 keys] as bf16 pairs; values: [key pair][D] as bf16 pairs
    thread_local std::vector<uint32_t> kt, vp, pb;
    kt.resize(len16 / 16 * (D / 2) * 16);
    for (int64_t kg = 0; kg < len16 / 16; ++kg) {  // 16 key rows -> D/2 registers of 16 keys' dim pairs
      const uint32_t* src[16];
      for (int64_t k = 0; k < 16; ++k) {
        const int64_t j = kg * 16 + k;
        src[k] = j < len ? reinterpret_cast<const uint32_t*>(key_row(kh, blocks, BS, D, j0 + j)) : nullptr;
      }
      for (int64_t cb = 0; cb < D / 32; ++cb) {
        __m512i r[16];
        for (int k = 0; k < 16; ++k)
          r[k] = src[k] != nullptr ? _mm512_loadu_si512(src[k] + cb * 16) : _mm512_setzero_si512();
        transpose16x16(r);
        for (int c = 0; c < 16; ++c) _mm512_storeu_si512(kt.data() + (kg * (D / 2) + cb * 16 + c) * 16, r[c]);
      }
    }
    // values: a key pair's rows interleaved (vpunpck{l,h}wd), so lane i of register 2c (2c + 1) holds
    // d = 32c + 8 (i / 4) + i % 4 (+ 4) of both keys; the accumulators are put back in order at the end
    const int64_t pairs = (len + 1) / 2;
    vp.resize(pairs * D);
    for (int64_t jp = 0; jp < pairs; ++jp) {
      const T* a = key_row(vh, blocks, BS, D, j0 + 2 * jp);
      const T* b = 2 * jp + 1 < len ? key_row(vh, blocks, BS, D, j0 + 2 * jp + 1) : nullptr;
      for (int64_t c = 0; c < D / 32; ++c) {
        const __m512i x = _mm512_loadu_si512(a + 32 * c);
        const __m512i y = b != nullptr ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp.data() + jp * D + 32 * c, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(vp.data() + jp * D + 32 * c + 16, _mm512_unpackhi_epi16(x, y));
      }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    // scores: 16 keys a register; 8 query vectors x 2 key groups per pass (16 independent vdpbf16ps chains,
    // each broadcast query pair used twice)
    constexpr int SB = 8;
    const int64_t groups16 = len16 / 16;
    for (int64_t kg = 0; kg < groups16; kg += 2) {
      const bool two = kg + 1 < groups16;
      const uint32_t* kb0 = kt.data() + kg * (D / 2) * 16;
      const uint32_t* kb1 = two ? kb0 + (D / 2) * 16 : kb0;
      for (int64_t r = 0; r < R; r += SB) {
        const int64_t vb = std::min<int64_t>(SB, R - r);
        const uint32_t* qp[SB];
        for (int64_t b = 0; b < SB; ++b) qp[b] = reinterpret_cast<const uint32_t*>(qrow(r + std::min(b, vb - 1)));
        __m512 a[SB], e[SB];
#pragma GCC unroll 8
        for (int b = 0; b < SB; ++b) a[b] = e[b] = _mm512_setzero_ps();
        for (int64_t dp = 0; dp < D / 2; ++dp) {
          const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb0 + dp * 16);
          const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb1 + dp * 16);
#pragma GCC unroll 8
          for (int b = 0; b < SB; ++b) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[b][dp]));
            a[b] = _mm512_dpbf16_ps(a[b], qb, k0);
            e[b] = _mm512_dpbf16_ps(e[b], qb, k1);
          }
        }
        for (int64_t b = 0; b < vb; ++b) {
          _mm512_storeu_ps(s.data() + (r + b) * ls + kg * 16, _mm512_mul_ps(a[b], sv));
          if (two) _mm512_storeu_ps(s.data() + (r + b) * ls + kg * 16 + 16, _mm512_mul_ps(e[b], sv));
        }
      }
    }
    const int64_t pst = (len + 31) / 32 * 16;  // a row's pairs, in whole 32-key registers
    pb.resize(R * pst);
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s.data() + r * ls;
      chunk_softmax(sr, len, vis0 + (r0 + r) / G, uo.m + r, uo.l + r);
      for (int64_t jb = 0; jb < len16; jb += 32) {  // probabilities as bf16 pairs (zeros past len)
        const __m512 hi = jb + 16 < len16 ? _mm512_loadu_ps(sr + jb + 16) : _mm512_setzero_ps();
        _mm512_storeu_si512(pb.data() + r * pst + jb / 2,
                            (__m512i)_mm512_cvtne2ps_pbh(hi, _mm512_loadu_ps(sr + jb)));
      }
    }
    constexpr int VB = std::max(1, 16 / NV);  // accumulators: VB x NV zmm
    for (int64_t r = 0; r < R; r += VB) {
      const int64_t vb = std::min<int64_t>(VB, R - r);
      __m512 a[VB][NV];
      for (int b = 0; b < VB; ++b)
        for (int cc = 0; cc < NV; ++cc) a[b][cc] = _mm512_setzero_ps();
      const uint32_t* pr[VB];
      for (int b = 0; b < VB; ++b) pr[b] = pb.data() + (r + std::min<int64_t>(b, vb - 1)) * pst;
      for (int64_t jp = 0; jp < pairs; ++jp) {
        __m512bh vv[NV];
        for (int cc = 0; cc < NV; ++cc) vv[cc] = (__m512bh)_mm512_loadu_si512(vp.data() + jp * D + cc * 16);
        for (int b = 0; b < VB; ++b) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[b][jp]));
          for (int cc = 0; cc < NV; ++cc) a[b][cc] = _mm512_dpbf16_ps(a[b][cc], p, vv[cc]);
        }
      }
      const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      for (int64_t b = 0; b < vb; ++b) {
        float* dst = uo.acc + (r + b) * D;
        for (int cc = 0; cc < NV; cc += 2) {
          _mm512_storeu_ps(dst + cc * 16, _mm512_permutex2var_ps(a[b][cc], first, a[b][cc + 1]));
          _mm512_storeu_ps(dst + cc * 16 + 16, _mm512_permutex2var_ps(a[b][cc], second, a[b][cc + 1]));
        }
      }
    }
    return;
  }
#endif
  // float32: keys as [16-key group][D][16 keys], values as rows, queries times the scale
  kf.assign(len16 * D, 0.f);
  vf.resize(len * D);
  for (int64_t j = 0; j < len; ++j) {
    const T* kp = key_row(kh, blocks, BS, D, j0 + j);
    const T* vp = key_row(vh, blocks, BS, D, j0 + j);
    float* dst = kf.data() + (j / 16) * D * 16 + j % 16;
    for (int64_t d = 0; d < D; ++d) dst[d * 16] = to_float(kp[d]);
    for (int cc = 0; cc < NV; ++cc) Vec16::load(vp + cc * 16).store(vf.data() + j * D + cc * 16);
  }
  qf.resize(R * D);
  for (int64_t r = 0; r < R; ++r) {
    const T* qp = qrow(r);
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = to_float(qp[d]) * scale;
  }
  constexpr int SB = kScoreVecs;
  for (int64_t kg = 0; kg < len16 / 16; ++kg) {
    const float* kb = kf.data() + kg * D * 16;
    for (int64_t r = 0; r < R; r += SB) {
      const int64_t vb = std::min<int64_t>(SB, R - r);
      const float* qp[SB];
      for (int b = 0; b < SB; ++b) qp[b] = qf.data() + (r + std::min<int64_t>(b, vb - 1)) * D;
      Vec16 a[SB];
#pragma GCC unroll 8
      for (int b = 0; b < SB; ++b) a[b] = Vec16::zero();
      for (int64_t d = 0; d < D; ++d) {
        const Vec16 kv = Vec16::load(kb + d * 16);
#pragma GCC unroll 8
        for (int b = 0; b < SB; ++b) a[b] = fmadd(Vec16::set1(qp[b][d]), kv, a[b]);
      }
      for (int64_t b = 0; b < vb; ++b) a[b].store(s.data() + (r + b) * ls + kg * 16);
    }
  }
  for (int64_t r = 0; r < R; ++r) chunk_softmax(s.data() + r * ls, len, vis0 + (r0 + r) / G, uo.m + r, uo.l + r);
  constexpr int VB = kPvVecs, SL = std::min(kSliceVecs, NV);
  for (int64_t r = 0; r < R; r += VB) {
    const int64_t vb = std::min<int64_t>(VB, R - r);
    const float* pr[VB];
    for (int b = 0; b < VB; ++b) pr[b] = s.data() + (r + std::min<int64_t>(b, vb - 1)) * ls;
    for (int c0 = 0; c0 < NV; c0 += SL) {  // a slice of the value rows at a time
      Vec16 a[VB][SL];
#pragma GCC unroll 4
      for (int b = 0; b < VB; ++b)
#pragma GCC unroll 4
        for (int cc = 0; cc < SL; ++cc) a[b][cc] = Vec16::zero();
      for (int64_t j = 0; j < len; ++j) {
        Vec16 vv[SL];
#pragma GCC unroll 4
        for (int cc = 0; cc < SL; ++cc) vv[cc] = Vec16::load(vf.data() + j * D + (c0 + cc) * 16);
#pragma GCC unroll 4
        for (int b = 0; b < VB; ++b) {
          const Vec16 p = Vec16::set1(pr[b][j]);
#pragma GCC unroll 4
          for (int cc = 0; cc < SL; ++cc) a[b][cc] = fmadd(p, vv[cc], a[b][cc]);
        }
      }
      for (int64_t b = 0; b < vb; ++b)
        for (int cc = 0; cc < SL; ++cc) a[b][cc].store(uo.acc + (r + b) * D + (c0 + cc) * 16);
    }
  }
}

template <int NV, typename T>
void cascade_impl(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* sl, T* out, int64_t N,
                  int64_t H, int64_t HKV, int64_t NB, int64_t BS, int64_t MB, float scale, int64_t P,
                  const float* sinks) {
  constexpr int64_t D = NV * 16;
  const int64_t G = H / HKV, Lp = P * BS, chunks = (Lp + kChunk - 1) / kChunk;
  // Scratch kept between calls (a layer's ~0.7 MB of fresh pages cost page faults every call); the
  // parallel regions below read it through these pointers (a thread_local named there would be that
  // thread's own, empty one).
  thread_local std::vector<float> scratch;
  scratch.resize(N * H * (D + 1) + chunks * N * H * (D + 2));
  float* o_s = scratch.data();  // the suffix: every row's own keys, float32 outputs and their log-sum-exp
  float* lse_s = o_s + N * H * D;
  float* pm = lse_s + N * H;  // the prefix's chunks: max, sum and unnormalized output per query head
  float* pl = pm + chunks * N * H;
  float* pacc = pl + chunks * N * H;
  decode_attention_fast<NV, T, float>(q, kc, vc, bt, sl, o_s, N, H, HKV, NB, BS, MB, scale, 0, Lp, lse_s);
  // the prefix: units of (kv head, chunk, group of query vectors)
  // chunk c's outputs for vector r of kv head h at (c * HKV + h) * N * G + r
  const int64_t vectors = N * G, groups = (vectors + kVectors - 1) / kVectors;
  at::parallel_for(0, HKV * chunks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t h = u / (chunks * groups), c = u / groups % chunks, vg = u % groups;
      const int64_t j0 = c * kChunk, r0 = vg * vectors / groups, r1 = (vg + 1) * vectors / groups;
      const int64_t at = (c * HKV + h) * vectors + r0, len = std::min(kChunk, Lp - j0);
      prefix_unit<NV, T>(q, H, G, kc + h * NB * BS * D, vc + h * NB * BS * D, bt, BS, j0, len, r0, r1 - r0, h, scale,
                         len, UnitOut{pm + at, pl + at, pacc + at * D});
    }
  });
  at::parallel_for(0, N * H, 16, [&](int64_t begin, int64_t end) {  // merge: per query head
    for (int64_t i = begin; i < end; ++i) {
      const int64_t vec = i / H * G + i % H % G, h = i % H / G;  // query head i: row i / H, head i % H
      float mx = lse_s[i];
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, pm[(c * HKV + h) * N * G + vec]);
      const float ws = std::exp(lse_s[i] - mx);  // 0 where the row has no keys of its own (lse -inf)
      float total = ws + (sinks != nullptr ? std::exp(sinks[i % H] - mx) : 0.f);  // the attention sink's share
      Vec16 o[NV];
      for (int cc = 0; cc < NV; ++cc) o[cc] = Vec16::set1(ws) * Vec16::load(o_s + i * D + cc * 16);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t t = (c * HKV + h) * N * G + vec;
        const float w = std::exp(pm[t] - mx);
        total += w * pl[t];
        const Vec16 wv = Vec16::set1(w);
        for (int cc = 0; cc < NV; ++cc) o[cc] = fmadd(wv, Vec16::load(pacc + t * D + cc * 16), o[cc]);
      }
      const Vec16 inv = Vec16::set1(1.f / total);
      for (int cc = 0; cc < NV; ++cc) store16(out + i * D + cc * 16, o[cc] * inv);
    }
  });
}
}  // namespace

void cascade_decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& bt, const at::Tensor& sl, double scale, int64_t num_prefix_blocks,
                              const float* sinks, at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), HKV = key_cache.size(0), NB = key_cache.size(1),
                BS = key_cache.size(2), MB = bt.size(1), P = num_prefix_blocks;
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "cascade attention: head size 64, 128 or 256, got ", D);
  TORCH_CHECK(P <= MB, "cascade attention: ", P, " prefix blocks but block tables of ", MB);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(slp[n] >= P * BS, "cascade attention: seq_lens[", n, "] = ", slp[n], " is shorter than the ", P * BS,
                "-token shared prefix");
    TORCH_CHECK(std::memcmp(btp + n * MB, btp, P * sizeof(int64_t)) == 0, "cascade attention: row ", n,
                " does not share the first ", P, " blocks");
  }
  for (int64_t b = 0; b < P; ++b)
    TORCH_CHECK(btp[b] >= 0 && btp[b] < NB, "cascade attention: prefix block id ", btp[b], " outside [0, ", NB, ")");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const float sc = static_cast<float>(scale);
    auto go = [&](auto nv) {
      constexpr int NV = decltype(nv)::value;
      cascade_impl<NV, T>(q.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), btp, slp,
                          out.data_ptr<T>(), N, H, HKV, NB, BS, MB, sc, P, sinks);
    };
    if (D == 64) go(std::integral_constant<int, 4>());
    else if (D == 128) go(std::integral_constant<int, 8>());
    else go(std::integral_constant<int, 16>());
  };
  if (q.scalar_type() == at::kBFloat16) run(c10::BFloat16());
  else run(float());
}

}  // namespace vlite

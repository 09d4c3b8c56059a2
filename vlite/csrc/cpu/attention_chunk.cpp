// One key chunk's attention for a few query vectors (the decode kernel's unit, decode_attention.cpp; the
// cascade and prefill kernels reuse softmax_numerators and kBf16Dot): keys walked through the block table
// (SlotCursor), scores, softmax numerators and P.V in float32 Vec16 lanes, or `vdpbf16ps` dot products on a
// bf16 cache with AVX512_BF16. attend_chunk: one row's query heads; attend_group: several rows of one
// sequence sharing each block's conversion. Included by bindings.cpp before decode_attention.cpp.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace vlite {

namespace {
// Walks a request's keys j, j + 1, ... < j_end in order through its block table without a division
// per key. Entering a block, it prefetches the next one's rows (row_bytes each, at `base`): blocks are
// scattered, so the hardware prefetcher, which follows one block's rows, stalls at every block's
// start, and layer after layer the cache is read from L3 or DRAM, not L2.
struct SlotCursor {
  const int64_t* blocks;
  int64_t bs, bi, off, last_block, block_bytes;
  const char* base;
  SlotCursor(const int64_t* b, int64_t block_size, int64_t j, int64_t j_end, const void* rows, int64_t row_bytes)
      : blocks(b), bs(block_size), bi(j / block_size), off(j % block_size), last_block((j_end - 1) / block_size),
        block_bytes(block_size * row_bytes), base(static_cast<const char*>(rows)) {
    if (off != 0 && bi < last_block) prefetch(bi + 1);  // starting mid-block: the next one now
  }
  void prefetch(int64_t b) const {
    const char* p = base + blocks[b] * block_bytes;
    for (int64_t i = 0; i < block_bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
  }
  int64_t next() {
    if (off == 0 && bi < last_block) prefetch(bi + 1);
    const int64_t slot = blocks[bi] * bs + off;
    if (++off == bs) { off = 0; ++bi; }
    return slot;
  }
};

#if defined(VLITE_AVX512) && defined(__AVX512BF16__)
// bf16 keys on a CPU with AVX512_BF16: scores as `vdpbf16ps` dot products of the unscaled bf16 query
// (its exact values) with the keys, 32 products per instruction and no conversion of the keys, then
// times the scale. Half the instructions of float32 FMAs over converted keys; the products are exact
// in float32 either way, only the order of the sums differs (and every step runs this same code).
template <typename T>
constexpr bool kBf16Dot = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kBf16Dot = false;
#endif

#if defined(VLITE_AVX512) && defined(__AVX512BF16__)
// acc[g] = sum_j p_g[j] V[j] for bf16 values: `vdpbf16ps` over key pairs, each 32-bit lane holding
// (V[j][d], V[j+1][d]) (an unpack of the two rows) against the pair (p[j], p[j+1]) rounded to bf16:
// half the multiplies of float32 FMAs and no conversion of V. The probabilities' rounding (2^-9
// relative, like V's own) is the only change in value. Lane i of the unpacked registers holds
// d = 8 * (i / 4) + i % 4 (lo) or that + 4 (hi), put back in order at the end.
template <int NV, int GB>
void pv_bf16(const float* s, int64_t ls, int64_t padded, const c10::BFloat16* vh, const int64_t* blocks, int64_t BS,
             int64_t j0, int64_t len, float* acc) {
  constexpr int NP = NV / 2;  // 32 values of a V row per register
  constexpr int64_t D = NV * 16;
  __m512 al[GB][NP], ah[GB][NP];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NP; ++c) al[g][c] = ah[g][c] = _mm512_setzero_ps();
  alignas(64) uint32_t pp[GB][16];  // 32 keys' probabilities as 16 bf16 pairs
  SlotCursor vs(blocks, BS, j0, j0 + len, vh, D * sizeof(c10::BFloat16));
  for (int64_t jb = 0; jb < len; jb += 32) {
    for (int g = 0; g < GB; ++g) {  // s is written up to `padded` (a multiple of 16): zeros past it
      const float* sg = s + g * ls + jb;
      const __m512 hi = jb + 16 < padded ? _mm512_loadu_ps(sg + 16) : _mm512_setzero_ps();
      _mm512_store_si512(pp[g], (__m512i)_mm512_cvtne2ps_pbh(hi, _mm512_loadu_ps(sg)));
    }
    const int64_t cnt = std::min<int64_t>(32, len - jb);
    for (int64_t k = 0; k < cnt; k += 2) {
      const c10::BFloat16* va = vh + vs.next() * D;
      const c10::BFloat16* vb = k + 1 < cnt ? vh + vs.next() * D : nullptr;  // an odd last key: pair with 0
      for (int c = 0; c < NP; ++c) {
        const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(va + 32 * c));
        const __m512i b = vb != nullptr ? _mm512_loadu_si512(reinterpret_cast<const void*>(vb + 32 * c))
                                        : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < GB; ++g) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g][k / 2]));
          al[g][c] = _mm512_dpbf16_ps(al[g][c], p, lo);
          ah[g][c] = _mm512_dpbf16_ps(ah[g][c], p, hi);
        }
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NP; ++c) {
      _mm512_storeu_ps(acc + g * D + 32 * c, _mm512_permutex2var_ps(al[g][c], first, ah[g][c]));
      _mm512_storeu_ps(acc + g * D + 32 * c + 16, _mm512_permutex2var_ps(al[g][c], second, ah[g][c]));
    }
}
#endif

// One query vector's softmax numerators over its scores sg[0, len), in place, 16 at a time: its max m
// and the sum l of exp(s - m). Scores past len are padded with -inf up to a multiple of 16, whose exp
// (clamped at e^-87, ~1e-38) adds nothing a float32 sum of at least 1 can hold. (Scalar exps of the
// tail cost ~1 us per (request, kv head), as much as 100 keys.) attend_chunk and attend_group both
// call this one function: a row's bits are the same in either.
static inline void softmax_numerators(float* sg, int64_t len, float* m, float* l) {
  const int64_t padded = (len + 15) / 16 * 16;
  for (int64_t j = len; j < padded; ++j) sg[j] = -INFINITY;
  Vec16 mv = Vec16::set1(-INFINITY);
  for (int64_t j = 0; j < padded; j += 16) mv = vmax(mv, Vec16::load(sg + j));
  const float mx = mv.max();
  const Vec16 mm = Vec16::set1(mx);
  Vec16 sum = Vec16::zero();
  for (int64_t j = 0; j < padded; j += 16) {
    const Vec16 e = vexp(Vec16::load(sg + j) - mm);
    e.store(sg + j);
    sum = sum + e;
  }
  *m = mx;
  *l = sum.sum();
}

// The next cnt rows of a cache as float32 rows: float32 caches' rows in place, bf16 ones converted
// once into buf (cnt x D) for every query vector that reads them.
template <int NV, typename T>
static inline void float32_rows(const T* cache, SlotCursor& cur, int64_t cnt, float* buf, const float** rows) {
  constexpr int64_t D = NV * 16;
  for (int64_t k = 0; k < cnt; ++k) {
    const T* p = cache + cur.next() * D;
    if constexpr (std::is_same_v<T, float>) {
      rows[k] = p;
    } else {
      for (int c = 0; c < NV; ++c) Vec16::load(p + c * 16).store(buf + k * D + c * 16);
      rows[k] = buf + k * D;
    }
  }
}

#if defined(VLITE_AVX2)
// 16 scores of one query vector (qf: D floats) against the float32 key rows krow[0, 16) (rows past the
// block's keys may be any row: their scores are scratch): per key two 8-lane partial sums over D and
// their sum, then a transpose-add of 4 + 4 keys in registers. The same operations in the same order as
// storing the 16 partial-sum pairs and reduce16 (vec.h), without the 32 stores and reloads per block.
template <int NV>
static inline void scores16(const float* qf, const float* const* krow, float* out) {
  __m256 qv[2 * NV];
#pragma GCC unroll 16
  for (int c = 0; c < 2 * NV; ++c) qv[c] = _mm256_loadu_ps(qf + 8 * c);
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    __m256 g[2];
#pragma GCC unroll 2
    for (int quad = 0; quad < 2; ++quad) {
      __m256 t[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const float* kp = krow[8 * half + 4 * quad + k];
        __m256 lo = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kp)), hi = _mm256_mul_ps(qv[1], _mm256_loadu_ps(kp + 8));
#pragma GCC unroll 16
        for (int c = 1; c < NV; ++c) {
          lo = _mm256_fmadd_ps(qv[2 * c], _mm256_loadu_ps(kp + 16 * c), lo);
          hi = _mm256_fmadd_ps(qv[2 * c + 1], _mm256_loadu_ps(kp + 16 * c + 8), hi);
        }
        t[k] = _mm256_add_ps(lo, hi);
      }
      g[quad] = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    }
    _mm256_storeu_ps(out + 8 * half,
                     _mm256_add_ps(_mm256_permute2f128_ps(g[0], g[1], 0x20), _mm256_permute2f128_ps(g[0], g[1], 0x31)));
  }
}

// P.V on AVX2 (16 ymm registers): a 32-value slice of D at a time for up to 3 query vectors with the
// same keys, so that each V row's slice is loaded (and converted) once for all of them while their 12
// accumulators stay in registers. Vector by vector, the whole row needed 8 accumulators and reloaded V
// for every vector (9 loads per 8 FMAs: load-bound), and 3 query heads at once spilled 24 accumulators.
// Every lane still gets the same FMAs over the keys in order (acc = p_j * V_j[d] + acc): the same bits.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) { return load_bf16x8(p); }

template <int VB, typename T>
static inline void pv_slice(const float* const* p, const T* const* rows, int64_t n, int64_t off, float* const* acc) {
  // (Unrolled by pragma: without it GCC 12 kept the accumulator array on the stack, stored every key.)
  __m256 a[VB][4];
  const float* pv[VB];
  float* av[VB];
#pragma GCC unroll 4
  for (int i = 0; i < VB; ++i) {
    pv[i] = p[i];
    av[i] = acc[i] + off;
  }
#pragma GCC unroll 4
  for (int i = 0; i < VB; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[i][c] = _mm256_loadu_ps(av[i] + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* vp = rows[j] + off;
    __m256 b[VB];
#pragma GCC unroll 4
    for (int i = 0; i < VB; ++i) b[i] = _mm256_broadcast_ss(pv[i] + j);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256 x = load8(vp + 8 * c);
#pragma GCC unroll 4
      for (int i = 0; i < VB; ++i) a[i][c] = _mm256_fmadd_ps(b[i], x, a[i][c]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < VB; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(av[i] + 8 * c, a[i][c]);
}

// acc[v * D, (v + 1) * D) += sum_{j < n[v]} p[v * ls + j] V_j for QB vectors (V_j = rows[j]): runs of
// consecutive vectors with the same key count (a row's query heads) in groups of at most 3.
template <int NV, typename T>
static inline void pv_vectors(const float* p, int64_t ls, const int64_t* n, int64_t QB, const T* const* rows,
                              float* acc) {
  constexpr int64_t D = NV * 16;
  static_assert(D % 32 == 0, "P.V slices of 32 values");
  for (int64_t v = 0; v < QB;) {
    int64_t e = v + 1;
    while (e < QB && e - v < 3 && n[e] == n[v]) ++e;
    const float* pp[3] = {p + v * ls, p + std::min(v + 1, QB - 1) * ls, p + std::min(v + 2, QB - 1) * ls};
    float* ap[3] = {acc + v * D, acc + std::min(v + 1, QB - 1) * D, acc + std::min(v + 2, QB - 1) * D};
    for (int64_t off = 0; off < D; off += 32) {
      if (e - v == 3) pv_slice<3>(pp, rows, n[v], off, ap);
      else if (e - v == 2) pv_slice<2>(pp, rows, n[v], off, ap);
      else pv_slice<1>(pp, rows, n[v], off, ap);
    }
    v = e;
  }
}
#endif

// Query heads [0, GB) of one (request, kv head) against keys [j0, j1): the running max m, the sum
// of exp(s - m) l and the unnormalized output acc (GB x D), for the caller to normalize or merge.
// qf: the queries times the scale, as float32; qraw: the same queries as given (the bf16 dot path);
// s: scratch of GB rows of (j1 - j0 + 16) floats.
template <int NV, int GB, typename T>
void attend_chunk(const float* qf, const T* qraw, float scale, const T* kh, const T* vh, const int64_t* blocks,
                  int64_t BS, int64_t j0, int64_t j1, float* s, float* m, float* l, float* acc) {
  constexpr int64_t D = NV * 16;
  const int64_t len = j1 - j0, ls = len + 16;
  if (len <= 0) {
    for (int g = 0; g < GB; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.f;
      std::fill(acc + g * D, acc + (g + 1) * D, 0.f);
    }
    return;
  }
  alignas(64) float part[GB][256];
  SlotCursor ks(blocks, BS, j0, j1, kh, D * sizeof(T));
#if defined(VLITE_AVX512) && defined(__AVX512BF16__)
  if constexpr (kBf16Dot<T>) {
    constexpr int NP = NV / 2;  // 32 bf16 values per register
    __m512bh qb[GB][NP];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < NP; ++c)
        qb[g][c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(qraw + g * D + c * 32));
    const Vec16 sv = Vec16::set1(scale);
    for (int64_t jb = 0; jb < len; jb += 16) {
      const int64_t cnt = std::min<int64_t>(16, len - jb);
      for (int64_t k = 0; k < cnt; ++k) {
        const T* kp = kh + ks.next() * D;
        __m512bh kb[NP];
        for (int c = 0; c < NP; ++c) kb[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kp + c * 32));
        for (int g = 0; g < GB; ++g) {
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
          for (int c = 1; c < NP; ++c) a = _mm512_dpbf16_ps(a, qb[g][c], kb[c]);
          _mm512_storeu_ps(part[g] + 16 * k, a);
        }
      }
      for (int g = 0; g < GB; ++g) (reduce16(part[g]) * sv).store(s + g * ls + jb);
    }
  } else
#endif
  {
    Vec16 qv[GB][NV];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < NV; ++c) qv[g][c] = Vec16::load(qf + g * D + c * 16);
    for (int64_t jb = 0; jb < len; jb += 16) {  // scores of 16 keys, then 16 horizontal sums at once
      const int64_t cnt = std::min<int64_t>(16, len - jb);
      for (int64_t k = 0; k < cnt; ++k) {
        const T* kp = kh + ks.next() * D;
        Vec16 kv[NV];
        for (int c = 0; c < NV; ++c) kv[c] = Vec16::load(kp + c * 16);
        for (int g = 0; g < GB; ++g) {
          Vec16 a = qv[g][0] * kv[0];
          for (int c = 1; c < NV; ++c) a = fmadd(qv[g][c], kv[c], a);
          a.store(part[g] + 16 * k);
        }
      }
      // all 16 sums (rows past cnt are scratch, overwritten below): s has 16 floats of room past len
      for (int g = 0; g < GB; ++g) reduce16(part[g]).store(s + g * ls + jb);
    }
  }
  const int64_t padded = (len + 15) / 16 * 16;
  for (int g = 0; g < GB; ++g) softmax_numerators(s + g * ls, len, m + g, l + g);
#if defined(VLITE_AVX512) && defined(__AVX512BF16__)
  if constexpr (kBf16Dot<T>) {
    pv_bf16<NV, GB>(s, ls, padded, vh, blocks, BS, j0, len, acc);
    return;
  }
#endif
#if defined(VLITE_AVX2)
  thread_local std::vector<const T*> vrows;
  vrows.resize(len);
  SlotCursor vs(blocks, BS, j0, j1, vh, D * sizeof(T));
  for (int64_t j = 0; j < len; ++j) vrows[j] = vh + vs.next() * D;
  std::fill(acc, acc + GB * D, 0.f);
  int64_t counts[GB];
  for (int g = 0; g < GB; ++g) counts[g] = len;
  pv_vectors<NV>(s, ls, counts, GB, vrows.data(), acc);
#else
  Vec16 av[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) av[g][c] = Vec16::zero();
  SlotCursor vs(blocks, BS, j0, j1, vh, D * sizeof(T));
  for (int64_t j = 0; j < len; ++j) {
    const T* vp = vh + vs.next() * D;
    Vec16 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = Vec16::load(vp + c * 16);
    for (int g = 0; g < GB; ++g) {
      const Vec16 p = Vec16::set1(s[g * ls + j]);
      for (int c = 0; c < NV; ++c) av[g][c] = fmadd(p, vv[c], av[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) av[g][c].store(acc + g * D + c * 16);
#endif
}

template <int NV, typename T>
void attend_heads(const float* qf, const T* qraw, float scale, int64_t G, const T* kh, const T* vh,
                  const int64_t* blocks, int64_t BS, int64_t j0, int64_t j1, float* s, float* m, float* l,
                  float* acc) {
  constexpr int64_t D = NV * 16;
  constexpr int64_t kMaxGroup = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;  // query heads per pass over the keys
  for (int64_t g = 0; g < G;) {
    const int64_t gb = std::min(kMaxGroup, G - g);
    const float* qg = qf + g * D;
    const T* qr = qraw + g * D;
    float* ag = acc + g * D;
    switch (gb) {
      case 4: attend_chunk<NV, 4>(qg, qr, scale, kh, vh, blocks, BS, j0, j1, s, m + g, l + g, ag); break;
      case 3: attend_chunk<NV, 3>(qg, qr, scale, kh, vh, blocks, BS, j0, j1, s, m + g, l + g, ag); break;
      case 2: attend_chunk<NV, 2>(qg, qr, scale, kh, vh, blocks, BS, j0, j1, s, m + g, l + g, ag); break;
      default: attend_chunk<NV, 1>(qg, qr, scale, kh, vh, blocks, BS, j0, j1, s, m + g, l + g, ag); break;
    }
    g += gb;
  }
}

// Float32 arithmetic (any build but AVX512_BF16 with a bf16 cache) for QB query vectors of one kv
// head: the query heads of several rows of one sequence (a verify step's, a prompt's), against keys
// j0, j0 + 1, ...: vector v sees len[v] of them. Each block of 16 keys (and values) is converted to
// float32 once for all the rows, not once per row; otherwise every vector gets the operations of
// attend_chunk, in its order (scores, softmax, P.V), so its bits are those it gets alone.
// Outputs per vector as attend_chunk's; qf: QB x D; s: scratch of QB rows of ls >= max(len) + 16.
template <int NV, typename T>
void attend_group(const float* qf, const T* kh, const T* vh, const int64_t* blocks,
                  int64_t BS, int64_t j0, const int64_t* len, int64_t QB, float* s, int64_t ls, float* m, float* l,
                  float* acc) {
  constexpr int64_t D = NV * 16;
  int64_t lmax = 0;
  for (int64_t v = 0; v < QB; ++v) lmax = std::max(lmax, len[v]);
  alignas(64) float part[256];
  SlotCursor ks(blocks, BS, j0, j0 + lmax, kh, D * sizeof(T));
  {
    alignas(64) float kf[16 * D];
    const float* krow[16];
    for (int64_t jb = 0; jb < lmax; jb += 16) {  // scores of 16 keys, then 16 horizontal sums at once
      const int64_t cnt = std::min<int64_t>(16, lmax - jb);
      float32_rows<NV>(kh, ks, cnt, kf, krow);
#if defined(VLITE_AVX2)
      for (int64_t k = cnt; k < 16; ++k) krow[k] = krow[0];
      for (int64_t v = 0; v < QB; ++v)
        if (jb < len[v]) scores16<NV>(qf + v * D, krow, s + v * ls + jb);
#else
      for (int64_t v = 0; v < QB; ++v) {
        if (jb >= len[v]) continue;
        Vec16 qv[NV];
        for (int c = 0; c < NV; ++c) qv[c] = Vec16::load(qf + v * D + c * 16);
        for (int64_t k = 0; k < cnt; ++k) {
          const float* kp = krow[k];
          Vec16 a = qv[0] * Vec16::load(kp);
          for (int c = 1; c < NV; ++c) a = fmadd(qv[c], Vec16::load(kp + c * 16), a);
          a.store(part + 16 * k);
        }
        // all 16 sums (lanes past cnt are scratch, overwritten below): s has 16 floats of room past len
        reduce16(part).store(s + v * ls + jb);
      }
#endif
    }
  }
  for (int64_t v = 0; v < QB; ++v) softmax_numerators(s + v * ls, len[v], m + v, l + v);
  std::fill(acc, acc + QB * D, 0.f);
#if defined(VLITE_AVX2)
  {  // 16 values at a time as float32 rows, then P.V a slice of D for up to 3 vectors at a time
    alignas(64) float vf[16 * D];
    const float* vrow[16];
    std::vector<int64_t> n16(QB);
    SlotCursor vs(blocks, BS, j0, j0 + lmax, vh, D * sizeof(T));
    for (int64_t jb = 0; jb < lmax; jb += 16) {
      const int64_t cnt = std::min<int64_t>(16, lmax - jb);
      float32_rows<NV>(vh, vs, cnt, vf, vrow);
      for (int64_t v = 0; v < QB; ++v) n16[v] = std::max<int64_t>(0, std::min<int64_t>(cnt, len[v] - jb));
      pv_vectors<NV>(s + jb, ls, n16.data(), QB, vrow, acc);
    }
  }
#else
  alignas(64) float vf[16 * D];
  const float* vrow[16];
  SlotCursor vs(blocks, BS, j0, j0 + lmax, vh, D * sizeof(T));
  for (int64_t jb = 0; jb < lmax; jb += 16) {
    const int64_t cnt = std::min<int64_t>(16, lmax - jb);
    float32_rows<NV>(vh, vs, cnt, vf, vrow);
    for (int64_t v = 0; v < QB; ++v) {
      const int64_t n = std::min<int64_t>(cnt, len[v] - jb);
      if (n <= 0) continue;
      float* av = acc + v * D;
      Vec16 a[NV];
      for (int c = 0; c < NV; ++c) a[c] = Vec16::load(av + c * 16);
      const float* sg = s + v * ls + jb;
      for (int64_t k = 0; k < n; ++k) {
        const Vec16 p = Vec16::set1(sg[k]);
        for (int c = 0; c < NV; ++c) a[c] = fmadd(p, Vec16::load(vrow[k] + c * 16), a[c]);
      }
      for (int c = 0; c < NV; ++c) a[c].store(av + c * 16);
    }
  }
#endif
}
}  // namespace

}  // namespace vlite

// The arithmetic of Gated DeltaNet's linear attention (gated_delta.cpp binds it) for one value head of
// one request: the recurrent form, one token at a time, and the chunked form, up to kChunk tokens at a
// time in matrix products. State S [Dk, Dv] (float32, updated in place); per token t: q_t, k_t (l2-normalized
// where asked, q_t scaled), v_t, g_t <= 0 (log decay), beta_t:
//   S = exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S += k_t delta^T;  out_t = S^T q_t
//
// Chunked (a chunk of n tokens from state S0; b = cumsum(g) within the chunk, Gamma_i = exp(b_i)):
// the values the tokens write (u_i = delta_i) solve the unit lower-triangular system
//   u_i + sum_{j<i} beta_i exp(b_i - b_j) (k_i.k_j) u_j = beta_i (v_i - Gamma_i S0^T k_i)
// (the UT/WY transform of torch_chunk_gated_delta_rule, with its two solves folded into one: u = T R,
// T = (I + M)^-1 built by forward substitution, n^3/6 flops), then
//   out_i = Gamma_i S0^T q_i + sum_{j<=i} exp(b_i - b_j) (q_i.k_j) u_j
//   S     = Gamma_{n-1} S0 + sum_j exp(b_{n-1} - b_j) k_j u_j^T
// ~ 6 n Dk Dv + 1.5 n^2 (Dk + Dv) flops a chunk, all of it in `matmul` (register-blocked, 16 lanes a vector).
#include <ATen/ATen.h>

#include <vector>

#include "vec.h"

namespace vlite {
namespace gdn {

constexpr int64_t kChunk = 64;

#if defined(VLITE_AVX512)
constexpr int kRows = 8, kCols = 2;  // 16 zmm accumulators (of 32), 2 B loads + 1 broadcast a step
#elif defined(VLITE_AVX2)
constexpr int kRows = 6, kCols = 1;  // 12 ymm accumulators (of 16)
#else
constexpr int kRows = 4, kCols = 1;
#endif

// C[R, 16 CV] = (accumulate ? alpha C : 0) + A[R, K] B[K, 16 CV] (row strides lda, ldb, ldc)
template <int R, int CV>
inline void mm_block(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t K,
                     bool accumulate, float alpha) {
  Vec16 c[R][CV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < CV; ++v) c[r][v] = Vec16::zero();
  for (int64_t k = 0; k < K; ++k) {
    Vec16 b[CV];
    for (int v = 0; v < CV; ++v) b[v] = Vec16::load(B + k * ldb + 16 * v);
    for (int r = 0; r < R; ++r) {
      const Vec16 a = Vec16::set1(A[r * lda + k]);
      for (int v = 0; v < CV; ++v) c[r][v] = fmadd(a, b[v], c[r][v]);
    }
  }
  const Vec16 al = Vec16::set1(alpha);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < CV; ++v) {
      float* p = C + r * ldc + 16 * v;
      (accumulate ? fmadd(al, Vec16::load(p), c[r][v]) : c[r][v]).store(p);
    }
}

// C[M, N] = (accumulate ? alpha C : 0) + A[M, K] B[K, N], N a multiple of 16. Column panels outside
// (a panel of B stays in L1 while A's rows stream by); for triangular operands the panel of columns n0..
// runs its rows from row_begin(n0) on and a block of rows i0..i0+rows-1 its sum to k_end(i0, rows) (the
// entries of A past it are zero): the rows and terms a triangle skips are never computed.
template <typename RowBegin, typename KEnd>
void matmul(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M, int64_t N,
            int64_t K, bool accumulate, float alpha, RowBegin row_begin, KEnd k_end) {
  for (int64_t n0 = 0; n0 < N;) {
    const bool wide = N - n0 >= 16 * kCols;
    for (int64_t i0 = row_begin(n0); i0 < M; i0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - i0), kk = std::min<int64_t>(K, k_end(i0, rows));
      const float* a = A + i0 * lda;
      const float* b = B + n0;
      float* c = C + i0 * ldc + n0;
      with_count<kRows>(rows, [&](auto R) {
        if (wide)
          mm_block<decltype(R)::value, kCols>(a, lda, b, ldb, c, ldc, kk, accumulate, alpha);
        else
          mm_block<decltype(R)::value, 1>(a, lda, b, ldb, c, ldc, kk, accumulate, alpha);
      });
    }
    n0 += wide ? 16 * kCols : 16;
  }
}

inline void matmul(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
                   int64_t N, int64_t K, bool accumulate, float alpha) {
  matmul(A, lda, B, ldb, C, ldc, M, N, K, accumulate, alpha, [](int64_t) { return int64_t{0}; },
         [K](int64_t, int64_t) { return K; });
}

// One call's inputs: q, k [T, Hk, Dk], v [T, Hv, Dv] with row and head strides (elements contiguous),
// g, beta [T, Hv] contiguous float32, out [T, Hv, Dv] contiguous float32.
template <typename T>
struct Inputs {
  const T *q, *k, *v;
  int64_t sq0, sq1, sk0, sk1, sv0, sv1;
  const float *g, *beta;
  float* out;
  int64_t Hk, Hv, Dk, Dv;
  float scale;
  bool l2norm;

  // the value head's query and key of token t, float32, normalized (where asked) and the query scaled
  void load_qk(int64_t t, int64_t h, float* qd, float* kd) const {
    const int64_t hk = h / (Hv / Hk);
    load_vec(q + t * sq0 + hk * sq1, qd, scale);
    load_vec(k + t * sk0 + hk * sk1, kd, 1.f);
  }
  void load_vec(const T* src, float* dst, float mult) const {
    Vec16 ss = Vec16::zero();
    for (int64_t i = 0; i < Dk; i += 16) {
      const Vec16 x = Vec16::load(src + i);
      ss = fmadd(x, x, ss);
      x.store(dst + i);
    }
    // l2norm(x) = x * rsqrt(sum(x^2) + 1e-6), as transformers' (and FLA's)
    const float m = l2norm ? mult / std::sqrt(ss.sum() + 1e-6f) : mult;
    if (m == 1.f) return;
    const Vec16 mv = Vec16::set1(m);
    for (int64_t i = 0; i < Dk; i += 16) (Vec16::load(dst + i) * mv).store(dst + i);
  }
  void prefetch(int64_t t, int64_t h) const {
    const char* pq = reinterpret_cast<const char*>(q + t * sq0 + h / (Hv / Hk) * sq1);
    const char* pk = reinterpret_cast<const char*>(k + t * sk0 + h / (Hv / Hk) * sk1);
    const char* pv = reinterpret_cast<const char*>(v + t * sv0 + h * sv1);
    for (int64_t o = 0; o < Dk * (int64_t)sizeof(T); o += 64) {
      __builtin_prefetch(pq + o);
      __builtin_prefetch(pk + o);
    }
    for (int64_t o = 0; o < Dv * (int64_t)sizeof(T); o += 64) __builtin_prefetch(pv + o);
  }
  void load_v(int64_t t, int64_t h, float* vd) const {
    const T* src = v + t * sv0 + h * sv1;
    for (int64_t i = 0; i < Dv; i += 16) Vec16::load(src + i).store(vd + i);
  }
};

// Thread-local working memory, grown as needed and kept for the thread's next call.
inline float* scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if ((int64_t)buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

#if defined(VLITE_AVX512)
constexpr int kTile = 2;  // Vec16s of columns a pass over S keeps in flight: 4 sums of 4-cycle FMAs
#else
constexpr int kTile = 1;  // AVX2: a Vec16 is 2 registers already
#endif

// Columns c0 .. c0 + 16 CT of one pass over S [Dk, Dv], rows in order (the same sums, in the same order,
// in every form): where delta is given, S = decay S + k delta^T first (the update of the token before);
// where k2 is given, ks = S^T k2 and qs = S^T q2 of the (updated) S (the next token's reads).
template <int CT>
inline void recurrent_tile(float* S, int64_t Dk, int64_t Dv, int64_t c0, const float* delta, float decay,
                           const float* k, const float* k2, const float* q2, float* ks, float* qs) {
  Vec16 d[CT], ak[CT], aq[CT];
  for (int c = 0; c < CT; ++c) {
    ak[c] = aq[c] = Vec16::zero();
    if (delta != nullptr) d[c] = Vec16::load(delta + c0 + 16 * c);
  }
  const Vec16 dv = Vec16::set1(decay);
  for (int64_t a = 0; a < Dk; ++a) {
    float* s = S + a * Dv + c0;
    Vec16 x[CT];
    for (int c = 0; c < CT; ++c) x[c] = Vec16::load(s + 16 * c);
    if (delta != nullptr) {
      const Vec16 ka = Vec16::set1(k[a]);
      for (int c = 0; c < CT; ++c) {
        x[c] = fmadd(ka, d[c], dv * x[c]);
        x[c].store(s + 16 * c);
      }
    }
    if (k2 != nullptr) {
      const Vec16 kb = Vec16::set1(k2[a]), qb = Vec16::set1(q2[a]);
      for (int c = 0; c < CT; ++c) {
        ak[c] = fmadd(kb, x[c], ak[c]);
        aq[c] = fmadd(qb, x[c], aq[c]);
      }
    }
  }
  if (k2 != nullptr)
    for (int c = 0; c < CT; ++c) {
      ak[c].store(ks + c0 + 16 * c);
      aq[c].store(qs + c0 + 16 * c);
    }
}

inline void recurrent_pass(float* S, int64_t Dk, int64_t Dv, const float* delta, float decay, const float* k,
                           const float* k2, const float* q2, float* ks, float* qs) {
  int64_t c0 = 0;
  for (; c0 + 16 * kTile <= Dv; c0 += 16 * kTile)
    recurrent_tile<kTile>(S, Dk, Dv, c0, delta, decay, k, k2, q2, ks, qs);
  for (; c0 < Dv; c0 += 16) recurrent_tile<1>(S, Dk, Dv, c0, delta, decay, k, k2, q2, ks, qs);
}

// The recurrence for tokens t0 .. t0+n-1 of value head h from state S [Dk, Dv], in place: one pass over S
// a token (n + 1 in all), each applying one token's update and computing the next token's S^T k, S^T q.
template <typename T>
void recurrent(const Inputs<T>& in, int64_t h, int64_t t0, int64_t n, float* S) {
  const int64_t Dk = in.Dk, Dv = in.Dv;
  float* qb = scratch(4 * Dk + 4 * Dv);
  float *kb = qb + 2 * Dk, *vb = kb + 2 * Dk, *ks = vb + Dv, *qs = ks + Dv, *delta = qs + Dv;
  in.load_qk(t0, h, qb, kb);
  recurrent_pass(S, Dk, Dv, nullptr, 1.f, nullptr, kb, qb, ks, qs);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i, cur = (i % 2) * Dk, nxt = Dk - cur;
    in.load_v(t, h, vb);
    const float decay = std::exp(in.g[t * in.Hv + h]), beta = in.beta[t * in.Hv + h];
    Vec16 qk = Vec16::zero();
    for (int64_t a = 0; a < Dk; a += 16) qk = fmadd(Vec16::load(qb + cur + a), Vec16::load(kb + cur + a), qk);
    // delta = beta (v - decay S^T k); out = decay S^T q + (q.k) delta (= the updated S^T q)
    const Vec16 dv = Vec16::set1(decay), bv = Vec16::set1(beta), qkv = Vec16::set1(qk.sum());
    float* o = in.out + (t * in.Hv + h) * Dv;
    for (int64_t c = 0; c < Dv; c += 16) {
      const Vec16 d = bv * (Vec16::load(vb + c) - dv * Vec16::load(ks + c));
      d.store(delta + c);
      fmadd(qkv, d, dv * Vec16::load(qs + c)).store(o + c);
    }
    const bool more = i + 1 < n;
    if (more) in.load_qk(t + 1, h, qb + nxt, kb + nxt);
    recurrent_pass(S, Dk, Dv, delta, decay, kb + cur, more ? kb + nxt : nullptr, qb + nxt, ks, qs);
  }
}

// The working set of one chunk (floats): see `chunk`
inline int64_t chunk_scratch(int64_t Dk, int64_t Dv) {
  return 2 * kChunk * Dk + Dk * kChunk + kChunk * Dv + 2 * kChunk * Dv + 2 * kChunk * kChunk + kChunk * kChunk +
         kChunk * Dv + 5 * (kChunk + 16);
}

// Tokens t0 .. t0+n-1 (n <= kChunk) of value head h as one chunk, from state S [Dk, Dv], in place.
template <typename T>
void chunk(const Inputs<T>& in, int64_t h, int64_t t0, int64_t n, float* S) {
  const int64_t Dk = in.Dk, Dv = in.Dv, N16 = (n + 15) / 16 * 16, ldo = in.Hv * Dv;
  float* KQ = scratch(chunk_scratch(Dk, Dv));  // [2n, Dk]: keys, then queries
  float* KT = KQ + 2 * kChunk * Dk;             // [Dk, kChunk]: the keys transposed (then decayed)
  float* V = KT + Dk * kChunk;                  // [n, Dv]: values, then the right-hand sides R
  float* X = V + kChunk * Dv;                   // [2n, Dv]: K S0, then Q S0
  float* G = X + 2 * kChunk * Dv;               // [2 kChunk, kChunk]: k_i.k_j (rows 0..), q_i.k_j (rows kChunk..)
  float* Tm = G + 2 * kChunk * kChunk;          // [n, kChunk]: (I + M)^-1
  float* U = Tm + kChunk * kChunk;              // [n, Dv]: the values written, u
  float* b = U + kChunk * Dv;                   // cumulative log decay (padded to 16 past n)
  float* gam = b + kChunk + 16;                 // exp(b_i)
  float* beta = gam + kChunk + 16;
  float* e = beta + kChunk + 16;                // one row of exp(b_i - b_j)
  float* m = e + kChunk + 16;                   // one row of M

  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    if (i + 8 < n) in.prefetch(t0 + i + 8, h);  // rows a head's size apart: a prefetcher's miss
    in.load_qk(t0 + i, h, KQ + (n + i) * Dk, KQ + i * Dk);
    in.load_v(t0 + i, h, V + i * Dv);
    acc += in.g[(t0 + i) * in.Hv + h];
    b[i] = acc;
    beta[i] = in.beta[(t0 + i) * in.Hv + h];
  }
  for (int64_t i = n; i < N16; ++i) b[i] = acc;
  for (int64_t i = 0; i < N16; i += 16) vexp(Vec16::load(b + i)).store(gam + i);
  for (int64_t a = 0; a < Dk; ++a) {
    float* row = KT + a * kChunk;
    for (int64_t j = 0; j < n; ++j) row[j] = KQ[j * Dk + a];
    for (int64_t j = n; j < N16; ++j) row[j] = 0.f;
  }
  // X = [K; Q] S0; the Gram matrices K K^T (j < i) and Q K^T (j <= i), lower triangles only
  matmul(KQ, Dk, S, Dv, X, Dv, 2 * n, Dv, Dk, false, 1.f);
  const auto from_diag = [](int64_t n0) { return n0; };
  const auto full = [Dk](int64_t, int64_t) { return Dk; };
  matmul(KQ, Dk, KT, kChunk, G, kChunk, n, N16, Dk, false, 1.f, from_diag, full);
  matmul(KQ + n * Dk, Dk, KT, kChunk, G + kChunk * kChunk, kChunk, n, N16, Dk, false, 1.f, from_diag, full);
  // T = (I + M)^-1 row by row (T_i = e_i - sum_{j<i} M_ij T_j); P_ij = exp(b_i - b_j) (q_i.k_j) into G's rows
  for (int64_t i = 0; i < n; ++i) {
    const Vec16 bi = Vec16::set1(b[i]);
    for (int64_t j = 0; j <= i; j += 16)  // exp(b_i - b_j), read for j <= i only (past it: anything)
      vexp(bi - Vec16::load(b + j)).store(e + j);
    const float* gk = G + i * kChunk;
    float* p = G + (kChunk + i) * kChunk;
    for (int64_t j = 0; j < i; ++j) m[j] = beta[i] * e[j] * gk[j];
    for (int64_t j = 0; j <= i; ++j) p[j] *= e[j];
    for (int64_t j = i + 1; j < N16; ++j) p[j] = 0.f;
    float* ti = Tm + i * kChunk;
    for (int64_t c = 0; c < N16; ++c) ti[c] = c == i ? 1.f : 0.f;
    for (int64_t c0 = 0; c0 < i; c0 += 16) {  // T_j is zero past column j
      Vec16 t = Vec16::load(ti + c0);
      for (int64_t j = c0; j < i; ++j) t = fmadd(Vec16::set1(-m[j]), Vec16::load(Tm + j * kChunk + c0), t);
      t.store(ti + c0);
    }
  }
  // R_i = beta_i (v_i - Gamma_i (S0^T k_i)); u = T R
  for (int64_t i = 0; i < n; ++i) {
    const Vec16 bv = Vec16::set1(beta[i]), gv = Vec16::set1(gam[i]);
    for (int64_t c = 0; c < Dv; c += 16)
      (bv * (Vec16::load(V + i * Dv + c) - gv * Vec16::load(X + i * Dv + c))).store(V + i * Dv + c);
  }
  const auto tri = [n](int64_t i0, int64_t rows) { return std::min(n, i0 + rows); };
  const auto all_rows = [](int64_t) { return int64_t{0}; };
  matmul(Tm, kChunk, V, Dv, U, Dv, n, Dv, n, false, 1.f, all_rows, tri);
  // out_i = Gamma_i (S0^T q_i) + sum_{j<=i} P_ij u_j
  float* out = in.out + t0 * ldo + h * Dv;
  for (int64_t i = 0; i < n; ++i) {
    const Vec16 gv = Vec16::set1(gam[i]);
    for (int64_t c = 0; c < Dv; c += 16) (gv * Vec16::load(X + (n + i) * Dv + c)).store(out + i * ldo + c);
  }
  matmul(G + kChunk * kChunk, kChunk, U, Dv, out, ldo, n, Dv, n, true, 1.f, all_rows, tri);
  // S = Gamma_{n-1} S0 + sum_j exp(b_{n-1} - b_j) k_j u_j^T
  const Vec16 last = Vec16::set1(b[n - 1]);
  for (int64_t j = 0; j < n; j += 16) vexp(last - Vec16::load(b + j)).store(e + j);
  for (int64_t a = 0; a < Dk; ++a)
    for (int64_t j = 0; j < n; ++j) KT[a * kChunk + j] *= e[j];
  matmul(KT, kChunk, U, Dv, S, Dv, Dk, Dv, n, true, gam[n - 1]);
}

}  // namespace gdn
}  // namespace vlite

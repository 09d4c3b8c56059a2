// Dense float32 linear layers for steps of a few rows (decodes, speculative verify steps, small
// batches): y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) (+ residual[M, N]), w row-major as the model
// holds it (no repacked copy).
//
// Such steps are bound by reading the weights once, and torch's CPU GEMM reads them at 2-11 GB/s at
// M <= 64 (on a 2-core Zen 4 that streams 26-43 GB/s). Here each block of kN weight rows is read from
// memory once and, from L1, multiplied by every x row (which stay in L2), kM rows at a time: kN x kM
// accumulators of 16 lanes, then one reduce16 turns the lanes of all the block's products into sums.
//
// Every output is summed in the same order whatever M, N and the thread split: lane l of a product
// takes inputs l, l + 16, ... in order, the lanes are reduced by reduce16, then the last K % 16 inputs
// follow one by one. So a request's row has the same bits in any step size (a decode alone or in a
// batch, a verify step), as with the quantized kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <type_traits>

#include "ops.h"
#include "vec.h"

namespace vlite {

namespace dense {
// Block shapes and the most rows a step runs here (above: torch's GEMM, faster there), measured on a
// 2-core Zen 4 against F.linear at SmolLM2-135M's shapes (torch using AVX-512 even for the avx2 build:
// an AVX2-only CPU's torch is slower, so that bound is cautious). Weights streamed from memory, GB/s:
//   avx512 4 x 4: M=1 27-36 vs 9-14, M=16 15 vs 7, M=64 5.1 vs 4.0, M=128 2.8 vs 2.4, M=192 1.7 vs 1.7
//   avx2 3 x 2 (of 2 x 2, 2 x 3, 3 x 2, 4 x 2: 4 x 2 spills): M=16 13 vs 8, M=48 5.2 vs 4.9, M=64 4.0 vs 4.1
//   portable 2 x 2 (SSE2 here): M=4 13.6 vs 8.7, M=6 9.9 vs 10.8
#if defined(VLITE_AVX512)
constexpr int kN = 4, kM = 4;  // 16 accumulators of 32 zmm registers
constexpr int64_t kMaxRows = 128;
#elif defined(VLITE_AVX2)
constexpr int kN = 3, kM = 2;  // a Vec16 is 2 of the 16 ymm registers: 12 for accumulators
constexpr int64_t kMaxRows = 48;
#else
constexpr int kN = 2, kM = 2;
constexpr int64_t kMaxRows = 4;
#endif
static_assert(kN * kM <= 16, "one reduce16 sums a block's products");

// The next weight rows, asked for from memory while these are multiplied: `lines` cache lines from
// `p` on, spread evenly over `steps` calls of `step` (one per 16 inputs; no division in the loop)
struct Prefetch {
  const char* p;
  int64_t lines, steps, budget = 0;
  inline void step() {
    for (budget += lines; budget >= steps; budget -= steps, p += 64) {
#if defined(__GNUC__)
      __builtin_prefetch(p, 0, 2);  // to L2: the next block of long rows is over L1's size
#endif
    }
  }
};

// The lanes of the NB x MB products of w rows [NB, K] and x rows [MB, K] over their first K16
// inputs, as rows m * kN + n of `lanes` [16][16].
template <int NB, int MB>
static inline void block_lanes(const float* x, const float* w, int64_t K, int64_t K16, float* lanes, Prefetch& pf) {
  Vec16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = Vec16::zero();
  for (int64_t k = 0; k < K16; k += 16) {
    pf.step();
    Vec16 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = Vec16::load(w + n * K + k);
    for (int m = 0; m < MB; ++m) {
      const Vec16 xv = Vec16::load(x + m * K + k);
      for (int n = 0; n < NB; ++n) acc[m][n] = fmadd(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n].store(lanes + 16 * (m * kN + n));
}

// out rows [0, M) x columns [n0, n0 + nb) of the weight rows at w; `next`: the next block's rows
// (next_rows of them), asked for from memory over all the passes of x rows. The hardware prefetcher
// alone, or a prefetch of the whole next block in the first pass, left memory idle for the later
// passes: 16 rows read the weights at 12-15 GB/s, ~60% of the rate with the weights in cache.
// `lanes`: the thread's [16][16] buffer (rows a smaller block leaves unwritten are summed and dropped).
static void column_block(const float* x, int64_t M, const float* w, int64_t K, int64_t N, int64_t n0, int64_t nb,
                         const float* bias, const float* residual, float* out, const float* next, int64_t next_rows,
                         float* lanes) {
  const int64_t K16 = K / 16 * 16, passes = (M + kM - 1) / kM, lines = next_rows * K / 16;
  alignas(64) float sums[16];
  for (int64_t m0 = 0; m0 < M; m0 += kM) {
    const int64_t mb = std::min<int64_t>(kM, M - m0);
    const float* xm = x + m0 * K;
    const int64_t pass = m0 / kM;  // this pass asks for its share of the next block's lines
    Prefetch pf{reinterpret_cast<const char*>(next) + 64 * (lines * pass / passes),
                lines * (pass + 1) / passes - lines * pass / passes, K16 / 16};
    with_count<kN>(nb, [&](auto NB) {
      with_count<kM>(mb, [&](auto MB) {
        block_lanes<decltype(NB)::value, decltype(MB)::value>(xm, w, K, K16, lanes, pf);
      });
    });
    reduce16(lanes).store(sums);
    for (int64_t m = 0; m < mb; ++m) {
      const int64_t o = (m0 + m) * N + n0;
      for (int64_t n = 0; n < nb; ++n) {
        float s = sums[m * kN + n];
        for (int64_t k = K16; k < K; ++k) s += xm[m * K + k] * w[n * K + k];
        if (bias != nullptr) s += bias[n0 + n];
        if (residual != nullptr) s += residual[o + n];
        out[o + n] = s;
      }
    }
  }
}
}  // namespace dense

at::Tensor dense_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias,
                        c10::optional<at::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "dense_linear: float32 x and w");
  TORCH_CHECK(w.is_contiguous(), "dense_linear: w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  x = x.contiguous();  // a strided view (a few rows): copied
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "dense_linear: bias must be float32 [N]");
    bias = bias->contiguous();
    b = bias->data_ptr<float>();
  }
  const float* r = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 && residual->size(0) == M &&
                residual->size(1) == N, "dense_linear: residual must be float32 [M, N]");
    residual = residual->contiguous();
    r = residual->data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  using dense::kN;
  const int64_t blocks = (N + kN - 1) / kN;
  // a thread's share at least ~64 KB of weights: smaller layers run on one thread, not worth a wake-up
  const int64_t grain = std::max<int64_t>(1, (16 * 1024) / (kN * std::max<int64_t>(1, K)));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float lanes[16 * 16] = {};
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kN;
      const int64_t next_rows = blk + 1 < end ? std::min<int64_t>(kN, N - n0 - kN) : 0;
      dense::column_block(xp, M, wp + n0 * K, K, N, n0, std::min<int64_t>(kN, N - n0), b, r, op, wp + (n0 + kN) * K,
                          next_rows, lanes);
    }
  });
  return out;
}

int64_t dense_max_rows() { return dense::kMaxRows; }

}  // namespace vlite

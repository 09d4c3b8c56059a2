// Causal attention of one request's prompt chunk: rows at positions ctx .. ctx + Q - 1 over its keys
// 0 .. ctx + Q - 1. Blocked as cascade_attention.cpp's prefix, whose unit it runs: every row of a group
// sees the same keys up to its own position, so a chunk of kChunk keys is laid out once for the group's
// query vectors (rows x the kv head's query heads) and its scores and P.V are register-blocked over them;
// the diagonal chunk masks each row's later keys. A unit (kv head, group of rows) walks the chunks from
// key 0 and folds each into the rows' running max, sum and output (flash attention's online softmax).
//
// Why: torch's SDPA runs at ~130 GFLOP/s on these shapes in bf16 (masked: slower), the per-row decode
// kernel reads every key once per row (from L3 past ~1,500 keys); see docs/benchmarks.md.
//
// A row's sums depend only on its position and keys (chunks start at key multiples of kChunk; a group's
// other rows add exact zeros), so its output is the same bits however its prompt was cut into chunks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <vector>

#include "vec.h"

// Included by bindings.cpp after cascade_attention.cpp (prefix_unit, kChunk, kVectors).
namespace vlite {

namespace {
template <int NV, typename T>
void prefill_impl(const T* q, const T* kc, const T* vc, const int64_t* blocks, T* out, int64_t Q, int64_t H,
                  int64_t HKV, int64_t NB, int64_t BS, int64_t ctx, float scale, const float* sinks) {
  constexpr int64_t D = NV * 16;
  const int64_t G = H / HKV, rows = std::max<int64_t>(1, kVectors / G), groups = (Q + rows - 1) / rows;
  // Units handed out longest first (the last rows see the most keys) to whichever thread is free.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> run((D + 2) * rows * G), part((D + 2) * rows * G);
    for (int64_t u = next++; u < HKV * groups; u = next++) {
      const int64_t g = groups - 1 - u / HKV, h = u % HKV;
      const int64_t n0 = g * rows, n1 = std::min(Q, n0 + rows), R = (n1 - n0) * G, last = ctx + n1 - 1;
      float *M = run.data(), *L = M + R, *O = L + R;
      const UnitOut uo{part.data(), part.data() + R, part.data() + 2 * R};
      const T* kh = kc + h * NB * BS * D;
      const T* vh = vc + h * NB * BS * D;
      for (int64_t j0 = 0; j0 <= last; j0 += kChunk) {
        const int64_t len = std::min(kChunk, last + 1 - j0);
        prefix_unit<NV, T>(q, H, G, kh, vh, blocks, BS, j0, len, n0 * G, R, h, scale, ctx + 1 - j0, uo);
        if (j0 == 0) {  // every row sees key 0
          std::copy(part.data(), part.data() + (D + 2) * R, run.data());
          continue;
        }
        for (int64_t r = 0; r < R; ++r) {
          const float mx = std::max(M[r], uo.m[r]), a = std::exp(M[r] - mx), b = std::exp(uo.m[r] - mx);
          M[r] = mx;
          L[r] = L[r] * a + uo.l[r] * b;
          const Vec16 av = Vec16::set1(a), bv = Vec16::set1(b);
          for (int cc = 0; cc < NV; ++cc) {
            float* o = O + r * D + cc * 16;
            fmadd(bv, Vec16::load(uo.acc + r * D + cc * 16), av * Vec16::load(o)).store(o);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // an attention sink adds e^(sink - M) to the denominator
        const Vec16 inv = Vec16::set1(1.f / (L[r] + (sinks != nullptr ? std::exp(sinks[h * G + r % G] - M[r]) : 0.f)));
        T* dst = out + ((n0 + r / G) * H + h * G + r % G) * D;
        for (int cc = 0; cc < NV; ++cc) store16(dst + cc * 16, Vec16::load(O + r * D + cc * 16) * inv);
      }
    }
  });
}
}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_ids, int64_t context_len, double scale,
                             c10::optional<at::Tensor> sinks = c10::nullopt) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "prefill attention: query must be a contiguous [Q, H, D]");
  const int64_t Q = q.size(0), H = q.size(1), D = q.size(2), HKV = key_cache.size(0), NB = key_cache.size(1),
                BS = key_cache.size(2);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "prefill attention: head size 64, 128 or 256, got ", D);
  TORCH_CHECK(H % HKV == 0, "prefill attention: ", H, " query heads over ", HKV, " kv heads");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.scalar_type() == q.scalar_type() &&
                  value_cache.scalar_type() == q.scalar_type(),
              "prefill attention: contiguous caches of the query's dtype");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(), "prefill attention: int64 block ids");
  TORCH_CHECK(context_len >= 0 && block_ids.numel() * BS >= context_len + Q, "prefill attention: ", block_ids.numel(),
              " blocks of ", BS, " hold fewer than the ", context_len + Q, " keys");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < (context_len + Q + BS - 1) / BS; ++b)
    TORCH_CHECK(ids[b] >= 0 && ids[b] < NB, "prefill attention: block id ", ids[b], " outside [0, ", NB, ")");
  const float* sk = sinks_ptr(sinks, H, "prefill attention");
  at::Tensor out = at::empty_like(q);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto nv) {
      prefill_impl<decltype(nv)::value, T>(q.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), ids,
                                           out.data_ptr<T>(), Q, H, HKV, NB, BS, context_len,
                                           static_cast<float>(scale), sk);
    };
    if (D == 64) go(std::integral_constant<int, 4>());
    else if (D == 128) go(std::integral_constant<int, 8>());
    else go(std::integral_constant<int, 16>());
  };
  if (q.scalar_type() == at::kBFloat16) run(c10::BFloat16());
  else if (q.scalar_type() == at::kFloat) run(float());
  else TORCH_CHECK(false, "prefill attention: bf16 or float32, got ", q.scalar_type());
  return out;
}

}  // namespace vlite

// Paged attention for decode tokens: K/V read in place through the block table.
//
//   for each (request n, kv head h), in parallel:
//     s_g,j = (q[n, h*G + g] * scale) . K[h, block_table[n, j // B], j % B]    g < G, j < seq_len
//     out[n, h*G + g] = softmax_j(s_g) @ V[h, block(j), j % B]
//
// Scores, softmax and the output accumulator are float32, in Vec16 lanes (vec.h), so the same code
// runs on AVX-512, AVX2 and the portable build.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "vec.h"

namespace vlite {

namespace {
constexpr int64_t kMaxVecs = 64;  // G * D / 16 accumulators kept in registers/stack

template <typename T>
void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* sl, T* out,
                           int64_t N, int64_t H, int64_t HKV, int64_t D, int64_t NB, int64_t BS, int64_t MB,
                           float scale) {
  const int64_t G = H / HKV, nv = D / 16;
  at::parallel_for(0, N * HKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / HKV, h = task % HKV, len = sl[n];
      const int64_t* blocks = bt + n * MB;
      scores.resize(G * len + 16);
      const T* qp = q + (n * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(qp[i]) * scale;
      const T* kh = kc + h * NB * BS * D;
      const T* vh = vc + h * NB * BS * D;
      const bool fits = G * nv <= kMaxVecs;
      Vec16 qv[kMaxVecs];
      if (fits) for (int64_t i = 0; i < G * nv; ++i) qv[i] = Vec16::load(qf.data() + i * 16);
      for (int64_t j = 0; j < len; ++j) {
        const T* kp = kh + (blocks[j / BS] * BS + j % BS) * D;
        Vec16 kv[16];
        for (int64_t c = 0; c < nv; ++c) kv[c] = Vec16::load(kp + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          Vec16 a = Vec16::zero();
          for (int64_t c = 0; c < nv; ++c)
            a = fmadd(fits ? qv[g * nv + c] : Vec16::load(qf.data() + g * D + c * 16), kv[c], a);
          scores[g * len + j] = a.sum();
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * len;
        Vec16 mv = Vec16::set1(-INFINITY);
        int64_t j = 0;
        for (; j + 16 <= len; j += 16) mv = vmax(mv, Vec16::load(s + j));
        float m = mv.max();
        for (; j < len; ++j) m = std::max(m, s[j]);
        Vec16 sum = Vec16::zero();
        const Vec16 mm = Vec16::set1(m);
        for (j = 0; j + 16 <= len; j += 16) {
          Vec16 e = vexp(Vec16::load(s + j) - mm);
          e.store(s + j);
          sum = sum + e;
        }
        float total = sum.sum();
        for (; j < len; ++j) { s[j] = std::exp(s[j] - m); total += s[j]; }
        const float inv = 1.f / total;
        for (j = 0; j < len; ++j) s[j] *= inv;
      }
      Vec16 av[kMaxVecs];
      for (int64_t i = 0; i < G * nv && i < kMaxVecs; ++i) av[i] = Vec16::zero();
      if (!fits) std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const T* vp = vh + (blocks[j / BS] * BS + j % BS) * D;
        Vec16 vv[16];
        for (int64_t c = 0; c < nv; ++c) vv[c] = Vec16::load(vp + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          const Vec16 p = Vec16::set1(scores[g * len + j]);
          if (fits) {
            for (int64_t c = 0; c < nv; ++c) av[g * nv + c] = fmadd(p, vv[c], av[g * nv + c]);
          } else {
            for (int64_t c = 0; c < nv; ++c)
              fmadd(p, vv[c], Vec16::load(acc.data() + g * D + c * 16)).store(acc.data() + g * D + c * 16);
          }
        }
      }
      if (fits) for (int64_t i = 0; i < G * nv; ++i) av[i].store(acc.data() + i * 16);
      T* op = out + (n * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) op[i] = static_cast<T>(acc[i]);
    }
  });
}
}  // namespace

// query [N, H, D]; key_cache, value_cache [H_kv, num_blocks, block_size, D] (contiguous);
// block_table [N, max_blocks] int64; seq_lens [N] int64 -> out [N, H, D]
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type());
  TORCH_CHECK(query.size(1) % key_cache.size(0) == 0 && key_cache.size(3) == query.size(2));
  TORCH_CHECK(query.size(2) % 16 == 0 && query.size(2) <= 256, "head size must be a multiple of 16, at most 256");
  auto q = query.contiguous(); auto bt = block_table.contiguous(); auto sl = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    decode_attention_impl<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                                    value_cache.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),
                                    out.data_ptr<scalar_t>(), q.size(0), q.size(1), key_cache.size(0), q.size(2),
                                    key_cache.size(1), key_cache.size(2), bt.size(1), (float)scale);
  };
  if (q.scalar_type() == at::kBFloat16) run(c10::BFloat16());
  else if (q.scalar_type() == at::kFloat) run(float());
  else TORCH_CHECK(false, "paged_decode_attention: bf16 or float32 only");
  return out;
}

}  // namespace vlite

namespace vlite {
// kv_cache [2, H_kv, num_blocks, block_size, D] (contiguous); key, value [T, H_kv, D] (any strides
// with contiguous heads); slot_mapping [T] int64: cache slot of each token. One call instead of
// two index_copy_ per layer.
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && key.dim() == 3 && value.sizes() == key.sizes());
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && slot_mapping.scalar_type() == at::kLong);
  const int64_t T = key.size(0), HKV = key.size(1), D = key.size(2);
  TORCH_CHECK(kv_cache.size(1) == HKV && kv_cache.size(4) == D && slot_mapping.numel() == T);
  const int64_t slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t esize = kv_cache.element_size();
  auto sm = slot_mapping.contiguous();
  const int64_t* slot = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "write_kv_cache: slot out of range");
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* src[2] = {static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr())};
  const int64_t st[2][2] = {{key.stride(0), key.stride(1)}, {value.stride(0), value.stride(1)}};
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int kv = 0; kv < 2; ++kv)
        for (int64_t h = 0; h < HKV; ++h)
          std::memcpy(cache + (((kv * HKV + h) * slots) + slot[t]) * D * esize,
                      src[kv] + (t * st[kv][0] + h * st[kv][1]) * esize, D * esize);
  });
}
}  // namespace vlite

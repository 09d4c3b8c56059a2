// Gated DeltaNet (the linear-attention layers of Qwen3-Next / Qwen3.5) on varlen batches: R requests'
// tokens concatenated in T rows, request r owning rows query_start_loc[r] .. query_start_loc[r+1]-1 and
// the state slot state_idx[r] (a whole prompt, a chunk of one, or one decode token: the state carries on).
//   gdn_conv1d:         the causal depthwise convolution + SiLU, its conv state [S, C, K-1] in place
//   gated_delta_rule:   the gated delta rule, its state [S, Hv, Dk, Dv] in place (gated_delta_chunk.cpp)
//   gdn_gated_rms_norm: x * rsqrt(mean(x^2) + eps) * w * silu(z) (Qwen3_5RMSNormGated, norm before gate)
// Each computes what transformers' Qwen3_5GatedDeltaNet does (causal_conv1d_update / _fn, l2norm,
// torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule), in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <vector>

#include "vec.h"

// Included by bindings.cpp after gated_delta_chunk.cpp (gdn::recurrent, gdn::chunk).
namespace vlite {

namespace {
// query_start_loc and state_idx, checked, as int64 vectors
std::vector<int64_t> as_int64(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 1 && (t.scalar_type() == at::kLong || t.scalar_type() == at::kInt),
              what, ": a 1-D int32 or int64 tensor expected, got ", t.scalar_type(), " of shape ", t.sizes());
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

void check_batch(const char* op, const std::vector<int64_t>& qsl, const std::vector<int64_t>& slots, int64_t T,
                 int64_t S) {
  TORCH_CHECK(qsl.size() == slots.size() + 1, op, ": query_start_loc must hold R + 1 = ", slots.size() + 1,
              " offsets for the R = ", slots.size(), " entries of state_idx, got ", qsl.size());
  TORCH_CHECK(qsl.front() == 0 && qsl.back() == T, op, ": query_start_loc must start at 0 and end at T = ", T,
              ", got ", qsl.front(), " .. ", qsl.back());
  for (size_t r = 0; r + 1 < qsl.size(); ++r)
    TORCH_CHECK(qsl[r] <= qsl[r + 1], op, ": query_start_loc must be non-decreasing (", qsl[r], " > ", qsl[r + 1],
                " at request ", r, ")");
  std::vector<bool> used(S, false);
  for (size_t r = 0; r < slots.size(); ++r) {
    TORCH_CHECK(slots[r] >= 0 && slots[r] < S, op, ": state_idx[", r, "] = ", slots[r],
                " is out of range for a state of ", S, " slots");
    TORCH_CHECK(!used[slots[r]], op, ": state_idx repeats slot ", slots[r]);
    used[slots[r]] = true;
  }
}

inline Vec16 silu(Vec16 x) {
  const Vec16 one = Vec16::set1(1.f);
  const Vec16 s = one / (one + vexp(Vec16::zero() - vabs(x)));  // exp(-|x|): never overflows
  return x * select_ge0(x, s, one - s);
}

// Channels c0 .. c0+L-1 (L <= kConvChannels) of every request: y = state ++ x per channel, out[t] =
// silu(sum_j w[j] y[t + j]), state = y's last K-1. A token's L inputs are read together (a row's 1 KiB, not
// one cache line a row 32 KiB apart); the weights and the state, channel-major ([C, K], [S, C, K-1]), are
// transposed to [K, L] and [K-1, L] once a request (KK: K at compile time, the deinterleave then vectorized;
// 0: any K). Against 16 channels a task, AVX2, 2 threads: 512 tokens x 8192 channels 2.93 -> 2.08 ms,
// a decode step of 16 requests 272 -> 112 us.
constexpr int64_t kConvChannels = 256;

template <typename T, int KK>
void conv_channels(const T* x, int64_t sx, const float* w, float* state, T* out, int64_t so, const int64_t* qsl,
                   const int64_t* slots, int64_t R, int64_t C, int64_t K_, int64_t c0, int64_t L, float* buf) {
  const int64_t K = KK > 0 ? KK : K_, H = K - 1, LP = (L + 15) / 16 * 16, full = L / 16 * 16;
  float* wt = buf;            // [K, LP]
  float* hist = wt + K * LP;  // [K-1, LP]: the request's previous inputs
  float* tail = hist + K * LP;  // 16: a partial vector's inputs / outputs
  for (int64_t l = 0; l < LP; ++l)
    for (int64_t j = 0; j < K; ++j) wt[j * LP + l] = l < L ? w[(c0 + l) * K + j] : 0.f;
  const auto xrow = [&](int64_t t, int64_t v) -> Vec16 {  // x[t, c0+v : c0+v+16] as floats
    const T* p = x + t * sx + c0 + v;
    if (v < full) return Vec16::load(p);
    for (int64_t l = 0; l < 16; ++l) tail[l] = v + l < L ? to_float(p[l]) : 0.f;
    return Vec16::load(tail);
  };
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t0 = qsl[r], n = qsl[r + 1] - t0;
    if (n == 0) continue;
    float* st = state + slots[r] * C * H + c0 * H;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t j = 0; j < H; ++j) hist[j * LP + l] = st[l * H + j];
    for (int64_t j = 0; j < H; ++j)
      for (int64_t l = L; l < LP; ++l) hist[j * LP + l] = 0.f;
    const auto y = [&](int64_t i, int64_t v) { return i < H ? Vec16::load(hist + i * LP + v) : xrow(t0 + i - H, v); };
    for (int64_t t = 0; t < n; ++t) {
      T* o = out + (t0 + t) * so + c0;
      for (int64_t v = 0; v < LP; v += 16) {
        Vec16 acc = Vec16::zero();
        for (int64_t j = 0; j < K; ++j) acc = fmadd(Vec16::load(wt + j * LP + v), y(t + j, v), acc);
        if (v < full) {
          store16(o + v, silu(acc));
        } else {
          silu(acc).store(tail);
          for (int64_t l = 0; v + l < L; ++l) o[v + l] = static_cast<T>(tail[l]);
        }
      }
    }
    // the last K-1 of y, y[n + j]: from the old state where n < K-1, else inputs
    for (int64_t l = 0; l < L; ++l)
      for (int64_t j = 0; j < H; ++j)
        st[l * H + j] = n + j < H ? hist[(n + j) * LP + l] : to_float(x[(t0 + n + j - H) * sx + c0 + l]);
  }
}

template <typename T>
void conv_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& state, at::Tensor& out,
               const std::vector<int64_t>& qsl, const std::vector<int64_t>& slots) {
  const int64_t C = x.size(1), K = weight.size(1), R = slots.size(), parts = (C + kConvChannels - 1) / kConvChannels;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* w = weight.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  const int64_t sx = x.stride(0), so = out.stride(0);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf((2 * K - 1) * kConvChannels + 16);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * kConvChannels, L = std::min(kConvChannels, C - c0);
      if (K == 4)
        conv_channels<T, 4>(xp, sx, w, sp, op, so, qsl.data(), slots.data(), R, C, K, c0, L, buf.data());
      else
        conv_channels<T, 0>(xp, sx, w, sp, op, so, qsl.data(), slots.data(), R, C, K, c0, L, buf.data());
    }
  });
}

template <typename T>
gdn::Inputs<T> gdn_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, at::Tensor& out, double scale, bool l2norm) {
  return gdn::Inputs<T>{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), q.stride(0), q.stride(1), k.stride(0),
                        k.stride(1), v.stride(0), v.stride(1), g.data_ptr<float>(), beta.data_ptr<float>(),
                        out.data_ptr<float>(), k.size(1), v.size(1), k.size(2), v.size(2), (float)scale, l2norm};
}

// Segments of at least this many tokens run chunked; a decode step's single tokens, a verify step's few,
// the recurrence. AVX2 (Zen 3), Dk = Dv = 128, us per token and head, recurrent / chunked: 1 token
// 8.0 / 9.9, 8 tokens 2.0 / 2.3, 12: 1.78 / 1.82, 16: 1.72 / 1.70, 64: 2.15 / 1.97 (the recurrence
// reads and writes the 64 KiB state once a token, from L2: as fast as the chunked products here).
constexpr int64_t kChunkedMinTokens = 16;

template <typename T>
void gdn_impl(const gdn::Inputs<T>& in, float* state, const std::vector<int64_t>& qsl,
              const std::vector<int64_t>& slots, int64_t min_chunked) {
  const int64_t Hv = in.Hv, R = slots.size(), per_slot = Hv * in.Dk * in.Dv;
  // (request, value head) pairs, longest segments first, to whichever thread is free
  std::vector<int64_t> pairs;
  for (int64_t r = 0; r < R; ++r)
    if (qsl[r + 1] > qsl[r])
      for (int64_t h = 0; h < Hv; ++h) pairs.push_back(r * Hv + h);
  std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) {
    return qsl[a / Hv + 1] - qsl[a / Hv] > qsl[b / Hv + 1] - qsl[b / Hv];
  });
  const int64_t npairs = pairs.size();
  std::atomic<int64_t> next{0};
  const auto run = [&](int64_t, int64_t) {
    for (int64_t i = next++; i < npairs; i = next++) {
      const int64_t r = pairs[i] / Hv, h = pairs[i] % Hv, t0 = qsl[r], n = qsl[r + 1] - t0;
      float* S = state + slots[r] * per_slot + h * in.Dk * in.Dv;
      if (n < min_chunked) {
        gdn::recurrent(in, h, t0, n, S);
        continue;
      }
      for (int64_t c = 0; c < n; c += gdn::kChunk) gdn::chunk(in, h, t0 + c, std::min(gdn::kChunk, n - c), S);
    }
  };
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), npairs);
  if (nt <= 1)
    run(0, 1);
  else
    at::parallel_for(0, nt, 1, run);
}
}  // namespace

at::Tensor gdn_conv1d(const at::Tensor& x, const at::Tensor& weight, at::Tensor conv_state, const at::Tensor& state_idx,
                      const at::Tensor& query_start_loc) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gdn_conv1d: x must be [T, C] float32 or bfloat16 with contiguous rows, got ", x.scalar_type(),
              " of shape ", x.sizes());
  const int64_t T_ = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.size(1) >= 2 && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              "gdn_conv1d: weight must be a contiguous float32 [C, K] with C = ", C, " and K >= 2, got ",
              weight.scalar_type(), " of shape ", weight.sizes());
  const int64_t K = weight.size(1);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == C && conv_state.size(2) == K - 1 &&
                  conv_state.scalar_type() == at::kFloat && conv_state.is_contiguous(),
              "gdn_conv1d: conv_state must be a contiguous float32 [S, C, K-1] = [S, ", C, ", ", K - 1, "], got ",
              conv_state.scalar_type(), " of shape ", conv_state.sizes());
  const auto qsl = as_int64(query_start_loc, "gdn_conv1d: query_start_loc");
  const auto slots = as_int64(state_idx, "gdn_conv1d: state_idx");
  check_batch("gdn_conv1d", qsl, slots, T_, conv_state.size(0));
  at::Tensor out = at::empty({T_, C}, x.options());
  if (x.scalar_type() == at::kFloat)
    conv_impl<float>(x, weight, conv_state, out, qsl, slots);
  else
    conv_impl<c10::BFloat16>(x, weight, conv_state, out, qsl, slots);
  return out;
}

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor state, const at::Tensor& state_idx,
                            const at::Tensor& query_start_loc, double scale, bool use_qk_l2norm,
                            int64_t chunked_min_tokens) {
  const char* op = "gated_delta_rule";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op, ": q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.sizes() == k.sizes(), op, ": q and k must have the same shape [T, Hk, Dk], got ", q.sizes(), " and ",
              k.sizes());
  const int64_t T_ = k.size(0), Hk = k.size(1), Dk = k.size(2), Hv = v.size(1), Dv = v.size(2);
  TORCH_CHECK(v.size(0) == T_, op, ": v must have T = ", T_, " rows like q and k, got ", v.size(0));
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              op, ": q, k, v must share a dtype, float32 or bfloat16, got ", q.scalar_type(), ", ", k.scalar_type(),
              ", ", v.scalar_type());
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, op, ": the value heads Hv = ", Hv, " must be a multiple of the key heads Hk = ",
              Hk);
  TORCH_CHECK(Dk % 16 == 0 && Dv % 16 == 0 && Dk > 0 && Dv > 0 && Dk <= 1024 && Dv <= 1024, op,
              ": head sizes Dk = ", Dk, ", Dv = ", Dv, " must be multiples of 16 (up to 1024)");
  for (const auto& [t, name] : {std::pair{&g, "g"}, std::pair{&beta, "beta"}})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T_ && t->size(1) == Hv && t->scalar_type() == at::kFloat, op, ": ",
                name, " must be float32 [T, Hv] = [", T_, ", ", Hv, "], got ", t->scalar_type(), " of shape ",
                t->sizes());
  TORCH_CHECK(state.dim() == 4 && state.size(1) == Hv && state.size(2) == Dk && state.size(3) == Dv &&
                  state.scalar_type() == at::kFloat && state.is_contiguous(),
              op, ": state must be a contiguous float32 [S, Hv, Dk, Dv] = [S, ", Hv, ", ", Dk, ", ", Dv, "], got ",
              state.scalar_type(), " of shape ", state.sizes());
  const auto qsl = as_int64(query_start_loc, "gated_delta_rule: query_start_loc");
  const auto slots = as_int64(state_idx, "gated_delta_rule: state_idx");
  check_batch(op, qsl, slots, T_, state.size(0));
  // rows may have any stride, a row's heads any stride; a head's elements must be contiguous
  const auto rows = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const at::Tensor qc = rows(q), kc = rows(k), vc = rows(v), gc = g.contiguous(), bc = beta.contiguous();
  at::Tensor out = at::empty({T_, Hv, Dv}, q.options().dtype(at::kFloat));
  const int64_t min_chunked = chunked_min_tokens > 0 ? chunked_min_tokens : kChunkedMinTokens;
  if (q.scalar_type() == at::kFloat)
    gdn_impl(gdn_inputs<float>(qc, kc, vc, gc, bc, out, scale, use_qk_l2norm), state.data_ptr<float>(), qsl, slots,
             min_chunked);
  else
    gdn_impl(gdn_inputs<c10::BFloat16>(qc, kc, vc, gc, bc, out, scale, use_qk_l2norm), state.data_ptr<float>(), qsl,
             slots, min_chunked);
  return out;
}

at::Tensor gdn_gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gdn_gated_rms_norm: x must be float32 [N, D], got ",
              x.scalar_type(), " of shape ", x.sizes());
  const int64_t N = x.size(0), D = x.size(1);
  TORCH_CHECK(D % 16 == 0, "gdn_gated_rms_norm: D = ", D, " must be a multiple of 16");
  TORCH_CHECK(z.sizes() == x.sizes() && (z.scalar_type() == at::kFloat || z.scalar_type() == at::kBFloat16),
              "gdn_gated_rms_norm: z must be float32 or bfloat16 [N, D] = [", N, ", ", D, "], got ", z.scalar_type(),
              " of shape ", z.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D && weight.scalar_type() == at::kFloat,
              "gdn_gated_rms_norm: weight must be float32 [D] = [", D, "], got ", weight.scalar_type(), " of shape ",
              weight.sizes());
  const at::Tensor xc = x.contiguous(), zc = z.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty({N, D}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto norm = [&](auto* zp) {
    at::parallel_for(0, N, row_grain(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* xr = xp + r * D;
        Vec16 acc = Vec16::zero();
        for (int64_t i = 0; i < D; i += 16) {
          const Vec16 v = Vec16::load(xr + i);
          acc = fmadd(v, v, acc);
        }
        const Vec16 inv = Vec16::set1(1.f / std::sqrt(acc.sum() / static_cast<float>(D) + (float)eps));
        for (int64_t i = 0; i < D; i += 16)
          (Vec16::load(wp + i) * (Vec16::load(xr + i) * inv) * silu(Vec16::load(zp + r * D + i))).store(op + r * D + i);
      }
    });
  };
  if (z.scalar_type() == at::kFloat)
    norm(zc.data_ptr<float>());
  else
    norm(zc.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace vlite

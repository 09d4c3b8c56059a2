// Small per-layer operations fused into one call each: at one decode token per step, the model's
// time goes to calling ~30 torch ops per layer, not to their arithmetic.
//   rms_norm:       y = w * (x / sqrt(mean(x^2) + eps)), statistics in float32
//   silu_and_mul:   y = silu(gate) * up for gate_up = [gate | up]
//   rotary_inplace: the first `heads` heads of each token rotated in place (rotate-half form)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec.h"

namespace vlite {

namespace {
template <typename T>
void rms_norm_impl(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      T* yr = y + r * D;
      Vec16 acc = Vec16::zero();
      for (int64_t i = 0; i < D; i += 16) {
        const Vec16 v = Vec16::load(xr + i);
        acc = fmadd(v, v, acc);
      }
      const Vec16 inv = Vec16::set1(1.f / std::sqrt(acc.sum() / static_cast<float>(D) + eps));
      for (int64_t i = 0; i < D; i += 16) store16(yr + i, Vec16::load(xr + i) * inv * Vec16::load(w + i));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const T* gu, T* y, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, row_grain(3 * I), [&](int64_t begin, int64_t end) {
    const Vec16 one = Vec16::set1(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * I;
      const T* u = g + I;
      for (int64_t i = 0; i < I; i += 16) {
        const Vec16 gv = Vec16::load(g + i);
        const Vec16 e = vexp(Vec16::zero() - vabs(gv));  // exp(-|g|): never overflows
        const Vec16 s = one / (one + e);
        const Vec16 sig = select_ge0(gv, s, one - s);  // sigmoid(g)
        store16(y + r * I + i, gv * sig * Vec16::load(u + i));
      }
    }
  });
}

template <typename T>
void rotary_impl(T* x, int64_t T_, int64_t stride, int64_t heads, int64_t D, const float* cos, const float* ssin) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    float tmp[512];
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * D;
      const float* s = ssin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + t * stride + h * D;
        if (half % 16 == 0) {  // x[i] * c[i] + x[i +- half] * s[i], 16 lanes at a time
          for (int64_t i = 0; i < half; i += 16) {
            const Vec16 a = Vec16::load(xh + i), b = Vec16::load(xh + half + i);
            store16(xh + i, a * Vec16::load(c + i) + b * Vec16::load(s + i));
            store16(xh + half + i, b * Vec16::load(c + half + i) + a * Vec16::load(s + half + i));
          }
          continue;
        }
        for (int64_t i = 0; i < D; ++i) tmp[i] = to_float(xh[i]);
        for (int64_t i = 0; i < D; ++i) xh[i] = static_cast<T>(tmp[i] * c[i] + tmp[(i + half) % D] * s[i]);
      }
    }
  });
}
}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.size(-1) == weight.numel() && x.size(-1) % 16 == 0, "rms_norm: hidden size must match, multiple of 16");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  const int64_t D = x.size(-1), rows = xc.numel() / D;
  if (x.scalar_type() == at::kFloat)
    rms_norm_impl(xc.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, D, (float)eps);
  else if (x.scalar_type() == at::kBFloat16)
    rms_norm_impl(xc.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows,
                  D, (float)eps);
  else
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  return y;
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 32 == 0, "silu_and_mul: [T, 2I] with I a multiple of 16");
  auto gu = gate_up.contiguous();
  const int64_t rows = gu.size(0), I = gu.size(1) / 2;
  auto y = at::empty({rows, I}, gu.options());
  if (gu.scalar_type() == at::kFloat)
    silu_and_mul_impl(gu.data_ptr<float>(), y.data_ptr<float>(), rows, I);
  else if (gu.scalar_type() == at::kBFloat16)
    silu_and_mul_impl(gu.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, I);
  else
    TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  return y;
}

// x [T, stride] (rows of heads of size D, contiguous rows): heads 0..heads-1 rotated in place;
// cos, signed_sin [T, D] float32 (rotate-half's sign folded into the sine)
void rotary_inplace(at::Tensor x, int64_t heads, int64_t head_dim, at::Tensor cos, at::Tensor signed_sin) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && head_dim <= 512 && heads * head_dim <= x.size(1), "rotary: bad x");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && signed_sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              signed_sin.is_contiguous() && cos.numel() == x.size(0) * head_dim, "rotary: cos/sin [T, D] float32");
  if (x.scalar_type() == at::kFloat)
    rotary_impl(x.data_ptr<float>(), x.size(0), x.stride(0), heads, head_dim, cos.data_ptr<float>(),
                signed_sin.data_ptr<float>());
  else if (x.scalar_type() == at::kBFloat16)
    rotary_impl(x.data_ptr<c10::BFloat16>(), x.size(0), x.stride(0), heads, head_dim, cos.data_ptr<float>(),
                signed_sin.data_ptr<float>());
  else
    TORCH_CHECK(false, "rotary: float32 or bfloat16 only");
}

}  // namespace vlite

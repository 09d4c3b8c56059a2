"""A C++ paged-attention kernel for decode tokens: K/V read in place through the block table.

The torch path (`torch_sdpa._attend_decodes`) gathers every decode request's K/V blocks into a
copy padded to the longest request, then runs batched matmuls. This kernel instead walks each
(request, KV head) pair's own blocks: scores, softmax and the output accumulator in float32 AVX-512
registers, the pairs spread over torch's intra-op threads. Measured on the 2-core dev machine
(bf16, ~250-token contexts, per layer): 1 decode 53 -> 13 us, 8 decodes 199 -> 126 us, 32 decodes
725 -> 529 us.

It is compiled on first use with torch.utils.cpp_extension (a C++ compiler and ninja; ~20 s once,
then cached under ~/.cache/torch_extensions, keyed by the CPU's flags since it is built with
-march=native). Without a compiler or AVX-512, or with VLITE_CPU_KERNELS=0, the torch path runs.

    for each (request n, kv head h), in parallel:
        s_g,j = (q[n, h*G + g] * scale) . K[h, block_table[n, j // B], j % B]    g < G, j < seq_len
        out[n, h*G + g] = softmax_j(s_g) @ V[h, block(j), j % B]
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any, Optional

import torch

from vlite.config import cpu_flags

logger = logging.getLogger(__name__)

ENV_VAR = "VLITE_CPU_KERNELS"

_SOURCE = r"""#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
static inline __m512 load16(const at::BFloat16* p) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// exp for x <= 0 (softmax after subtracting the max): 2^k * p(r), |rel err| ~1e-7
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}
#endif

template <typename T>
static void impl(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* sl, T* out, int64_t N,
                 int64_t H, int64_t HKV, int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale) {
  const int64_t G = H / HKV;
  at::parallel_for(0, N * HKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / HKV, h = task % HKV, len = sl[n];
      const int64_t* blocks = bt + n * MB;
      scores.resize(G * len + 16);
      const T* qp = q + (n * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qp[i]) * scale;
      const T* kh = kc + h * NB * BS * D;
      const T* vh = vc + h * NB * BS * D;
#if defined(__AVX512F__)
      if (D % 16 == 0 && D <= 256) {
        const int64_t nv = D / 16;
        __m512 qv[4 * 16];  // G * nv <= 64 vectors
        const bool fits = G * nv <= 64;
        if (fits) for (int64_t i = 0; i < G * nv; ++i) qv[i] = _mm512_loadu_ps(qf.data() + i * 16);
        for (int64_t j = 0; j < len; ++j) {
          const T* kp = kh + (blocks[j / BS] * BS + j % BS) * D;
          __m512 kv[16];
          for (int64_t c = 0; c < nv; ++c) kv[c] = load16(kp + c * 16);
          for (int64_t g = 0; g < G; ++g) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t c = 0; c < nv; ++c)
              a = _mm512_fmadd_ps(fits ? qv[g * nv + c] : _mm512_loadu_ps(qf.data() + g * D + c * 16), kv[c], a);
            scores[g * len + j] = _mm512_reduce_add_ps(a);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * len;
          __m512 mv = _mm512_set1_ps(-INFINITY);
          int64_t j = 0;
          for (; j + 16 <= len; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
          float m = _mm512_reduce_max_ps(mv);
          for (; j < len; ++j) m = std::max(m, s[j]);
          __m512 sum = _mm512_setzero_ps();
          const __m512 mm = _mm512_set1_ps(m);
          for (j = 0; j + 16 <= len; j += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mm));
            _mm512_storeu_ps(s + j, e);
            sum = _mm512_add_ps(sum, e);
          }
          float total = _mm512_reduce_add_ps(sum);
          for (; j < len; ++j) { s[j] = std::exp(s[j] - m); total += s[j]; }
          const float inv = 1.f / total;
          for (j = 0; j < len; ++j) s[j] *= inv;
        }
        __m512 av[4 * 16];
        for (int64_t i = 0; i < G * nv && i < 64; ++i) av[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; ++j) {
          const T* vp = vh + (blocks[j / BS] * BS + j % BS) * D;
          __m512 vv[16];
          for (int64_t c = 0; c < nv; ++c) vv[c] = load16(vp + c * 16);
          for (int64_t g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * len + j]);
            if (fits) {
              for (int64_t c = 0; c < nv; ++c) av[g * nv + c] = _mm512_fmadd_ps(p, vv[c], av[g * nv + c]);
            } else {
              for (int64_t c = 0; c < nv; ++c)
                _mm512_storeu_ps(acc.data() + g * D + c * 16,
                                 _mm512_fmadd_ps(p, vv[c], _mm512_loadu_ps(acc.data() + g * D + c * 16)));
            }
          }
        }
        if (fits) for (int64_t i = 0; i < G * nv; ++i) _mm512_storeu_ps(acc.data() + i * 16, av[i]);
        T* op = out + (n * H + h * G) * D;
        for (int64_t i = 0; i < G * D; ++i) op[i] = static_cast<T>(acc[i]);
        continue;
      }
#endif
      TORCH_CHECK(false, "paged_decode_attention: unsupported head size ", D, " (call supported() first)");
    }
  });
}

// Whether this build has the vector path (compiled for a CPU with AVX-512).
bool supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// query [N, H, D]; key_cache, value_cache [H_kv, num_blocks, block_size, D] (contiguous);
// block_table [N, max_blocks] int64; seq_lens [N] int64 -> out [N, H, D]
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type());
  TORCH_CHECK(query.size(1) % key_cache.size(0) == 0 && key_cache.size(3) == query.size(2));
  auto q = query.contiguous(); auto bt = block_table.contiguous(); auto sl = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    impl<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                   bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0), q.size(1),
                   key_cache.size(0), q.size(2), key_cache.size(1), key_cache.size(2), bt.size(1), (float)scale);
  };
  if (q.scalar_type() == at::kBFloat16) run(at::BFloat16());
  else if (q.scalar_type() == at::kFloat) run(float());
  else TORCH_CHECK(false, "bf16 or float32 only");
  return out;
}
"""

_module: Any = None
_loaded = False


def _build_name() -> str:
    """-march=native code must not be loaded on another CPU sharing the build cache."""
    key = _SOURCE + cpu_flags() + torch.__version__
    return "vlite_decode_attn_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _remove_stale_lock(name: str, max_age_s: float = 600.0) -> None:
    """torch waits forever on the lock file of a build that was killed midway (e.g. Ctrl-C during
    the first start); a compile takes well under max_age_s, so an older lock is stale."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > max_age_s:
            os.remove(lock)
    except Exception:  # a private torch helper: never let this step fail the load
        pass


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def load() -> Optional[Any]:
    """The compiled kernel module, or None (disabled, no compiler, no AVX-512): use the torch path.

    module.paged_decode_attention(query [N, H, D], key_cache, value_cache [H_kv, num_blocks,
    block_size, D], block_table [N, max_blocks] int64, seq_lens [N] int64, scale) -> [N, H, D]
    """
    global _module, _loaded
    if _loaded:
        return _module
    _loaded = True
    if not enabled():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        name = _build_name()
        _remove_stale_lock(name)
        logger.info("loading the C++ decode-attention kernel (compiled on first use, ~20 s, then cached)")
        module = load_inline(name=name, cpp_sources=[_SOURCE],
                             functions=["paged_decode_attention", "supported"],
                             extra_cflags=["-O3", "-march=native"], verbose=False)
        _module = module if module.supported() else None
        if _module is None:
            logger.info("this CPU has no AVX-512: decode attention uses the torch path")
    except Exception as e:  # no compiler, no ninja, an unwritable cache ...: the torch path works everywhere
        message = str(e).strip().splitlines()
        logger.warning("C++ decode-attention kernel unavailable, using the torch path: %s",
                       message[-1] if message else type(e).__name__)
        _module = None
    return _module


def can_run(query: torch.Tensor) -> bool:
    """Shapes and dtypes the vector path handles (head_dim a multiple of 16, at most 256)."""
    head_dim = query.shape[-1]
    return query.dtype in (torch.bfloat16, torch.float32) and head_dim % 16 == 0 and head_dim <= 256

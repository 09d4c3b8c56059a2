// Paged attention for decode tokens: K/V read in place through the block table.
//
//   for each (request n, kv head h), in parallel:
//     s_g,j = (q[n, h*G + g] * scale) . K[h, block_table[n, j // B], j % B]    g < G, j < seq_len
//     out[n, h*G + g] = softmax_j(s_g) @ V[h, block(j), j % B]
//
// Attention sinks (gpt-oss): where `sinks` [H] float32 is given, query head i's softmax denominator also holds
// e^sinks[i] (a key with a score and no value): out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[i] - m)).
//
// Scores, softmax and the output accumulator are float32, in Vec16 lanes (vec.h), so the same code
// runs on AVX-512, AVX2 and the portable build. With a bf16 cache on a CPU with AVX512_BF16, the
// scores and the P.V sums are `vdpbf16ps` dot products into float32 instead (kBf16Dot, pv_bf16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace vlite {

namespace {
constexpr int64_t kMaxVecs = 64;  // G * D / 16 accumulators kept in registers/stack (generic path)

// Any head size (a multiple of 16): one task per (request, kv head), loops over runtime sizes.
template <typename T>
void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* sl, T* out,
                           int64_t N, int64_t H, int64_t HKV, int64_t D, int64_t NB, int64_t BS, int64_t MB,
                           float scale, int64_t window, const float* sinks) {
  const int64_t G = H / HKV, nv = D / 16;
  at::parallel_for(0, N * HKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / HKV, h = task % HKV, len = sl[n];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0, cnt = len - first;
      const int64_t* blocks = bt + n * MB;
      scores.resize(G * cnt + 16);
      const T* qp = q + (n * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(qp[i]) * scale;
      const T* kh = kc + h * NB * BS * D;
      const T* vh = vc + h * NB * BS * D;
      const bool fits = G * nv <= kMaxVecs;
      Vec16 qv[kMaxVecs];
      if (fits) for (int64_t i = 0; i < G * nv; ++i) qv[i] = Vec16::load(qf.data() + i * 16);
      for (int64_t j = first; j < len; ++j) {
        const T* kp = kh + (blocks[j / BS] * BS + j % BS) * D;
        Vec16 kv[16];
        for (int64_t c = 0; c < nv; ++c) kv[c] = Vec16::load(kp + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          Vec16 a = Vec16::zero();
          for (int64_t c = 0; c < nv; ++c)
            a = fmadd(fits ? qv[g * nv + c] : Vec16::load(qf.data() + g * D + c * 16), kv[c], a);
          scores[g * cnt + j - first] = a.sum();
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * cnt;
        float m = -INFINITY;
        for (int64_t j = 0; j < cnt; ++j) m = std::max(m, s[j]);
        float total = sinks != nullptr ? std::exp(sinks[h * G + g] - m) : 0.f;
        for (int64_t j = 0; j < cnt; ++j) { s[j] = std::exp(s[j] - m); total += s[j]; }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < cnt; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = first; j < len; ++j) {
        const T* vp = vh + (blocks[j / BS] * BS + j % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const Vec16 p = Vec16::set1(scores[g * cnt + j - first]);
          for (int64_t c = 0; c < nv; ++c)
            fmadd(p, Vec16::load(vp + c * 16), Vec16::load(acc.data() + g * D + c * 16)).store(acc.data() + g * D + c * 16);
        }
      }
      T* op = out + (n * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) op[i] = static_cast<T>(acc[i]);
    }
  });
}

// attention_chunk.cpp (included before this file by bindings.cpp): SlotCursor, kBf16Dot, attend_chunk,
// attend_heads, attend_group, softmax_numerators.

// Head sizes 64, 128, 256 (NV = D / 16): registers sized at compile time, 16 horizontal sums at a
// time, and a sequence's keys in chunks (up to kMaxSplit of them, of at least kSplitKeys keys),
// merged flash-decoding style, so that one request with 3 kv heads still gives 2 threads even work.
// A row's chunks depend on its own length only, never on the batch or the thread count: its output
// is then the same bits in any step, and a speculative verify step's or a prompt's rows are computed
// as the decodes they stand for (the split was by batch size: a 1-row decode split where a 9-row
// verify step did not, and int8 activations magnified the last-bit difference to 0.04-0.09 nats).
// Inner chunk bounds fall on multiples of 16 keys, so consecutive rows of one sequence (a verify
// step's, a prompt's) mostly share them and run as one group: up to kGroupRows rows whose query
// vectors share every key block read (the last chunk of each row ends at the row's own length).
// 8 rows, not 4: AVX2, 2 threads, verify rows of one sequence: 9 rows at 400 keys 78 -> 74 us, 16 rows at
// 1500 keys 482 -> 443 (fewer conversions of each block); 16 lost at 16 rows of 200 keys (too few units).
constexpr int64_t kSplitKeys = 128, kMaxSplit = 8, kGroupRows = 8;

// Where rows gain from sharing key blocks: bf16 caches on the float32 path (one conversion of each block
// for all rows, not one per row: a 9-row verify step at 300 keys 1.22x, prompts of 128-1024 tokens
// 1.25-1.40x on AVX2) and float32 caches on AVX2 (1.16-1.30x: the per-row path's accumulators do not
// fit its 16 registers). Not vdpbf16ps (it reads bf16 keys as they are) nor AVX-512 with a float32
// cache (0.84-0.92x at 9-32 rows: its per-row path keeps queries and accumulators in 32 registers).
template <typename T>
#if defined(VLITE_AVX512)
constexpr bool kShareKeyBlocks = !kBf16Dot<T> && !std::is_same_v<T, float>;
#else
constexpr bool kShareKeyBlocks = true;
#endif

// key p of a row's chunk bounds: [first, ..., first + cnt] over S chunks
static inline int64_t chunk_bound(int64_t first, int64_t cnt, int64_t S, int64_t p) {
  if (p == 0) return first;
  if (p == S) return first + cnt;
  return first + (cnt * p / S + 15) / 16 * 16;
}

// O: the output's type (T; float for a cascade's suffix, merged before its one rounding). key_start: no
// row reads keys before it (a cascade's shared prefix, attended apart); lse: where given, each query
// head's log-sum-exp [N, H] (-inf for a row with no keys, whose output is then 0), of the keys alone; sinks: see
// the top (not with lse: a cascade adds them in its merge).
template <int NV, typename T, typename O = T>
void decode_attention_fast(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* sl, O* out,
                           int64_t N, int64_t H, int64_t HKV, int64_t NB, int64_t BS, int64_t MB, float scale,
                           int64_t window, int64_t key_start = 0, float* lse = nullptr, const float* sinks = nullptr) {
  constexpr int64_t D = NV * 16;
  const int64_t G = H / HKV;
  // per row: its first key, key count and chunks; where its (kv head, chunk) partial results start
  // one allocation (small steps: a decode row per layer spends ~1 us on set-up)
  std::vector<int64_t> work(7 * N + 3, 0);
  int64_t *first = work.data(), *cnt = first + N, *splits = cnt + N, *row_unit = splits + N;  // row_unit: N + 1
  int64_t *group_row = row_unit + N + 1, *group_table = group_row + N + 1, *group_unit = group_table + N;  // N + 1
  for (int64_t n = 0; n < N; ++n) {
    first[n] = std::max<int64_t>(key_start, window > 0 ? sl[n] - window : 0);
    cnt[n] = sl[n] - first[n];
    splits[n] = std::max<int64_t>(1, std::min(kMaxSplit, cnt[n] / kSplitKeys));
    row_unit[n + 1] = row_unit[n] + HKV * splits[n];
  }
  // rows that may share key reads: same first key (0), the same chunk bounds but the last, the same
  // blocks for every key either of them reads (rows of one sequence)
  auto joins = [&](int64_t a, int64_t b) {
    if (!kShareKeyBlocks<T>) return false;
    if (first[a] != key_start || first[b] != key_start || splits[a] != splits[b]) return false;
    for (int64_t p = 1; p < splits[a]; ++p)
      if (chunk_bound(first[a], cnt[a], splits[a], p) != chunk_bound(first[b], cnt[b], splits[b], p)) return false;
    const int64_t nblocks = (std::max(sl[a], sl[b]) + BS - 1) / BS;
    return std::memcmp(bt + a * MB, bt + b * MB, nblocks * sizeof(int64_t)) == 0;
  };
  // groups: runs of rows that join the run's first row, cut into near-equal pieces of at most
  // kGroupRows rows; every piece reads the blocks through the run's first row's table
  int64_t ngroups = 0;
  for (int64_t n = 0; n < N;) {
    int64_t e = n + 1;
    while (e < N && joins(n, e)) ++e;
    const int64_t pieces = (e - n + kGroupRows - 1) / kGroupRows;
    for (int64_t i = 1; i <= pieces; ++i) {
      group_table[ngroups] = n;
      group_row[++ngroups] = n + (e - n) * i / pieces;
    }
    n = e;
  }
  for (int64_t g = 0; g < ngroups; ++g) group_unit[g + 1] = group_unit[g] + HKV * splits[group_row[g]];
  const int64_t units = group_unit[ngroups];
  const bool any_split = row_unit[N] > N * HKV;
  std::vector<float> pm(any_split ? row_unit[N] * G : 0), pl(any_split ? row_unit[N] * G : 0),
      pacc(any_split ? row_unit[N] * G * D : 0);
  auto run_units = [&](int64_t begin, int64_t end) {
    std::vector<float> qf, s, m, l, acc;
    std::vector<int64_t> len;
    int64_t gi = std::upper_bound(group_unit, group_unit + ngroups + 1, begin) - group_unit - 1;
    for (int64_t unit = begin; unit < end; ++unit) {
      while (unit >= group_unit[gi + 1]) ++gi;
      const int64_t r0 = group_row[gi], R = group_row[gi + 1] - r0, S = splits[r0];
      const int64_t h = (unit - group_unit[gi]) / S, part = (unit - group_unit[gi]) % S, QB = R * G;
      const int64_t j0 = chunk_bound(first[r0], cnt[r0], S, part);
      qf.resize(QB * D); m.resize(QB); l.resize(QB); acc.resize(QB * D); len.resize(QB);
      int64_t lmax = 0;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t n = r0 + r, jn = chunk_bound(first[n], cnt[n], S, part + 1) - j0;
        lmax = std::max(lmax, jn);
        const T* qp = q + (n * H + h * G) * D;
        for (int64_t g = 0; g < G; ++g) len[r * G + g] = jn;
        if constexpr (!kBf16Dot<T>)
          for (int64_t i = 0; i < G * D; ++i) qf[r * G * D + i] = to_float(qp[i]) * scale;
      }
      const int64_t ls = lmax + 16;
      s.resize(QB * ls);
      const T* kh = kc + h * NB * BS * D;
      const T* vh = vc + h * NB * BS * D;
      const int64_t* blocks = bt + group_table[gi] * MB;
      if (R == 1)
        attend_heads<NV>(qf.data(), q + (r0 * H + h * G) * D, scale, G, kh, vh, blocks, BS, j0, j0 + len[0], s.data(),
                         m.data(), l.data(), acc.data());
      else
        attend_group<NV>(qf.data(), kh, vh, blocks, BS, j0, len.data(), QB, s.data(), ls, m.data(), l.data(),
                         acc.data());
      for (int64_t r = 0; r < R; ++r) {
        const int64_t n = r0 + r;
        if (S == 1) {  // the row's only chunk: its output
          O* op = out + (n * H + h * G) * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t v = r * G + g;
            if (lse != nullptr) lse[n * H + h * G + g] = l[v] > 0.f ? m[v] + std::log(l[v]) : -INFINITY;
            const float total = l[v] + (sinks != nullptr ? std::exp(sinks[h * G + g] - m[v]) : 0.f);
            const Vec16 inv = Vec16::set1(l[v] > 0.f ? 1.f / total : 0.f);  // no keys (a cascade's suffix): 0
            for (int c = 0; c < NV; ++c) store16(op + g * D + c * 16, Vec16::load(acc.data() + v * D + c * 16) * inv);
          }
          continue;
        }
        const int64_t t = (row_unit[n] + h * S + part) * G;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t v = r * G + g;
          pm[t + g] = m[v];
          pl[t + g] = l[v];
          std::memcpy(pacc.data() + (t + g) * D, acc.data() + v * D, D * sizeof(float));
        }
      }
    }
  };
  // Rows in groups: each thread a run of units of about equal cost (keys x (rows + 1/2): a group
  // shares the key conversions), not of equal count. A verify step's first row often groups alone
  // (its chunk bounds differ), and an even count gave one thread that row's units and the other
  // twice its work (AVX2, 9 rows at 256 keys: 73 -> 59 us). One row per unit: an even count.
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  if (ngroups == N || nt == 1) {
    at::parallel_for(0, units, 1, run_units);
  } else {
    std::vector<int64_t> cost(units + 1, 0);  // cumulative, in half row-keys
    for (int64_t g = 0; g < ngroups; ++g) {
      const int64_t r0 = group_row[g], R = group_row[g + 1] - r0, S = splits[r0];
      for (int64_t u = group_unit[g]; u < group_unit[g + 1]; ++u) {
        const int64_t part = (u - group_unit[g]) % S;
        const int64_t keys = chunk_bound(first[r0], cnt[r0], S, part + 1) - chunk_bound(first[r0], cnt[r0], S, part);
        cost[u + 1] = cost[u] + std::max<int64_t>(keys, 1) * (2 * R + 1);
      }
    }
    // The first unit of slice t: the slices before it get their share or up to a unit more, unless
    // that unit would be less than a quarter short. The calling thread starts first (its helpers wake
    // ~1 us later): cutting at the nearest unit gave it half a unit less and was 4% slower.
    auto unit_at = [&](int64_t t) {
      const int64_t target = cost[units] * t / nt;
      const int64_t i = std::lower_bound(cost.begin(), cost.end(), target) - cost.begin();
      return i > 0 && 4 * (target - cost[i - 1]) < cost[i] - cost[i - 1] ? i - 1 : i;
    };
    at::parallel_for(0, nt, 1, [&](int64_t tb, int64_t te) {
      for (int64_t t = tb; t < te; ++t) {
        const int64_t begin = t == 0 ? 0 : unit_at(t), end = t + 1 == nt ? units : unit_at(t + 1);
        if (begin < end) run_units(begin, end);
      }
    });
  }
  if (!any_split) return;
  at::parallel_for(0, N * HKV, 1, [&](int64_t begin, int64_t end) {  // merge the chunks of each split pair
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n = pair / HKV, h = pair % HKV, S = splits[n];
      if (S == 1) continue;
      const int64_t t0 = row_unit[n] + h * S;
      O* op = out + (n * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        float mx = -INFINITY;
        for (int64_t p = 0; p < S; ++p) mx = std::max(mx, pm[(t0 + p) * G + g]);
        float total = sinks != nullptr ? std::exp(sinks[h * G + g] - mx) : 0.f;
        Vec16 o[NV];
        for (int c = 0; c < NV; ++c) o[c] = Vec16::zero();
        for (int64_t p = 0; p < S; ++p) {
          const int64_t t = t0 + p;
          const float w = pl[t * G + g] > 0.f ? std::exp(pm[t * G + g] - mx) : 0.f;
          total += w * pl[t * G + g];
          const Vec16 wv = Vec16::set1(w);
          for (int c = 0; c < NV; ++c) o[c] = fmadd(wv, Vec16::load(pacc.data() + (t * G + g) * D + c * 16), o[c]);
        }
        if (lse != nullptr) lse[n * H + h * G + g] = mx + std::log(total);
        const Vec16 inv = Vec16::set1(1.f / total);
        for (int c = 0; c < NV; ++c) store16(op + g * D + c * 16, o[c] * inv);
      }
    }
  });
}
}  // namespace

// cascade_attention.cpp: the shared prefix once for every row, the rest per row, merged
void cascade_decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& bt, const at::Tensor& sl, double scale, int64_t num_prefix_blocks,
                              const float* sinks, at::Tensor& out);

// sinks: None, or float32 [H] (one per query head); the pointer the kernels read
inline const float* sinks_ptr(const c10::optional<at::Tensor>& sinks, int64_t H, const char* op) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 && sinks->size(0) == H,
              op, ": sinks must be a contiguous float32 [", H, "] (one per query head)");
  return sinks->data_ptr<float>();
}

// query [N, H, D]; key_cache, value_cache [H_kv, num_blocks, block_size, D] (contiguous);
// block_table [N, max_blocks] int64; seq_lens [N] int64 -> out [N, H, D]
// window > 0: each query sees only the last `window` keys of its sequence (sliding-window layers)
// num_prefix_blocks > 0 (no window; head size 64, 128 or 256): every row's first that many blocks are the
// same ones, attended once for all rows (cascade attention)
// sinks: float32 [H], each query head's attention sink (see the top), or None
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_table, at::Tensor seq_lens, double scale,
                                  int64_t window = 0, int64_t num_prefix_blocks = 0,
                                  c10::optional<at::Tensor> sinks = c10::nullopt) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type());
  TORCH_CHECK(query.size(1) % key_cache.size(0) == 0 && key_cache.size(3) == query.size(2));
  TORCH_CHECK(query.size(2) % 16 == 0 && query.size(2) <= 256, "head size must be a multiple of 16, at most 256");
  auto q = query.contiguous(); auto bt = block_table.contiguous(); auto sl = seq_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t N = q.size(0), D = q.size(2);
  const int64_t* slp = sl.data_ptr<int64_t>();
  const float* sk = sinks_ptr(sinks, q.size(1), "paged_decode_attention");
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(slp[n] >= 1 && slp[n] <= bt.size(1) * key_cache.size(2), "paged_decode_attention: seq_lens[", n,
                "] = ", slp[n], " is outside [1, ", bt.size(1) * key_cache.size(2), "]");
  if (num_prefix_blocks > 0) {
    TORCH_CHECK(window == 0, "paged_decode_attention: a shared prefix with a sliding window");
    cascade_decode_attention(q, key_cache, value_cache, bt, sl, scale, num_prefix_blocks, sk, out);
    return out;
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data_ptr<T>();
    const T* kp = key_cache.data_ptr<T>();
    const T* vp = value_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t H = q.size(1), HKV = key_cache.size(0), NB = key_cache.size(1), BS = key_cache.size(2),
                  MB = bt.size(1);
    const int64_t* btp = bt.data_ptr<int64_t>();
    const float sc = static_cast<float>(scale);
    switch (D) {
      case 64:
        decode_attention_fast<4>(qp, kp, vp, btp, slp, op, N, H, HKV, NB, BS, MB, sc, window, 0, nullptr, sk);
        break;
      case 128:
        decode_attention_fast<8>(qp, kp, vp, btp, slp, op, N, H, HKV, NB, BS, MB, sc, window, 0, nullptr, sk);
        break;
      case 256:
        decode_attention_fast<16>(qp, kp, vp, btp, slp, op, N, H, HKV, NB, BS, MB, sc, window, 0, nullptr, sk);
        break;
      default: decode_attention_impl<T>(qp, kp, vp, btp, slp, op, N, H, HKV, D, NB, BS, MB, sc, window, sk); break;
    }
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
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping) {
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

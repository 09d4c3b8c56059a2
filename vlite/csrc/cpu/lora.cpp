// Batched multi-LoRA updates of a linear layer's output: every row t of a step under the adapter in
// its slot gains, for each module (a [r, K], b_t [r, n], out_offset) the slot holds,
//
//     out[t, off:off + n] += (a @ x[t]) @ b_t        h = a @ x[t]: r float32 sums ("shrink")
//                                                    then one axpy per rank row ("expand")
//
// The rows are grouped by slot once per step (LoRAMapping, shared by every layer), so a slot's a and
// b_t are read from memory once for all its rows and reused from cache. Each call runs in two phases,
// both split into independent tasks: the shrink over blocks of a's rows, then the expand over blocks
// of output columns, each task for all the rows of one slot (a slot of one row, a decode: b_t read row
// by row). Deltas are summed in float32 and added to out with one rounding. The adapters' tensors are
// referenced, never copied.
//
// Included into bindings.cpp before decode_layer.cpp (whose fused layer applies LoRALinear).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace vlite {

// A step's rows grouped by adapter slot (-1: none), each slot's rows ascending.
struct LoRAMapping {
  struct Group {
    int64_t slot, begin, end;  // rows[begin:end]
  };
  int64_t tokens = 0, max_slot = -1;
  std::vector<int64_t> rows;
  std::vector<Group> groups;

  void set(const at::Tensor& token_slot) {
    TORCH_CHECK(token_slot.dim() == 1 && token_slot.device().is_cpu() &&
                (token_slot.scalar_type() == at::kInt || token_slot.scalar_type() == at::kLong),
                "LoRAMapping.set: token_slot must be a CPU int32 tensor [T]");
    clear();  // a bad slot leaves the mapping cleared
    const int64_t T = token_slot.size(0);
    std::vector<std::pair<int64_t, int64_t>> keyed;  // (slot, row): a stable sort keeps the rows ascending
    keyed.reserve(T);
    const auto read = [&](auto* p) {
      const int64_t stride = token_slot.stride(0);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t s = p[t * stride];
        TORCH_CHECK(s >= -1, "LoRAMapping.set: token_slot[", t, "] = ", s, " (a slot, or -1 for none)");
        if (s >= 0) keyed.emplace_back(s, t);
      }
    };
    if (token_slot.scalar_type() == at::kInt)
      read(token_slot.data_ptr<int32_t>());
    else
      read(token_slot.data_ptr<int64_t>());
    std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < keyed.size(); ++i) {
      if (i == 0 || keyed[i].first != keyed[i - 1].first) groups.push_back({keyed[i].first, (int64_t)i, (int64_t)i});
      groups.back().end = i + 1;
      rows.push_back(keyed[i].second);
    }
    if (!groups.empty()) max_slot = groups.back().slot;
    tokens = T;
  }
  void clear() {
    tokens = 0;
    max_slot = -1;
    rows.clear();
    groups.clear();
  }
  bool has_lora() const { return !groups.empty(); }
  int64_t num_tokens() const { return tokens; }
};

namespace lora {
// Register blocks, as in dense_linear.cpp: shrink kI a rows x kM x rows (16 lanes each, one reduce16
// for the block), expand kM rows x kV vectors of 16 output columns.
#if defined(VLITE_AVX512)
constexpr int kI = 4, kM = 4, kV = 4;  // 16 accumulators of 32 zmm registers
#elif defined(VLITE_AVX2)
constexpr int kI = 3, kM = 2, kV = 2;  // a Vec16 is 2 of 16 ymm registers
#else
constexpr int kI = 2, kM = 2, kV = 2;
#endif
static_assert(kI * kM <= 16, "one reduce16 sums a shrink block");
constexpr int64_t kColumns = 16 * kV;  // output columns per expand task: one register block
// A slot of one row reads b_t row by row instead (expand_row), in tasks of this many columns, kRowV
// vectors of accumulators at a time: a register block's columns read 64-128 bytes of each of r rows
// far apart, which memory serves slowly.
constexpr int64_t kRowColumns = 256;
#if defined(VLITE_AVX512)
constexpr int kRowV = 16;
#elif defined(VLITE_AVX2)
constexpr int kRowV = 6;
#else
constexpr int kRowV = 4;
#endif
// A task asks for the weights of the task this many after it (one streams too close behind)
constexpr int64_t kPrefetchTasks = 2;
// Below this many multiply-adds a call runs on the calling thread: a decode row's projection (SmolLM2,
// rank 16: 18-67 K) takes 1-3 us, and two threads gained at most a few % of a fused decode step while
// a busy machine (other processes on the cores) made their parallel regions stall for milliseconds.
// 32 rows over 3 slots on two threads: 3.0 -> 1.9 ms a step (rank 8, bf16).
constexpr int64_t kParallelWork = 1 << 18;

// A later task's weights asked for from memory while this one computes: `rows` runs of `row_lines`
// cache lines `stride` bytes apart, spread evenly over `steps` calls of step() (no division in the
// loop). A decode row reads each weight once, in streams of a few KB the hardware prefetcher barely
// starts on: 30 layers' rank-16 bf16 adapter out of cache, 1.3-1.45 -> ~1.0 ms a step on one core.
struct Prefetch {
  const char* row = nullptr;
  int64_t row_lines = 1, stride = 0, lines = 0, steps = 1, budget = 0, col = 0;
  void start(int64_t steps_) { steps = std::max<int64_t>(1, steps_); }
  inline void step() {
    for (budget += lines; budget >= steps; budget -= steps) {
      if (col == row_lines) {
        col = 0;
        row += stride;
      }
#if defined(__GNUC__)
      __builtin_prefetch(row + 64 * col, 0, 2);
#endif
      ++col;
    }
  }
};

// h[m * r + i0 + i] = a[i0 + i] . x[rows[m]] for the ib a rows at `a` and the M rows of the group
template <typename TW, typename TX>
static void shrink(const TW* a, int64_t K, int64_t ib, const TX* x, int64_t x_stride, const int64_t* rows,
                   int64_t M, float* h, int64_t r, int64_t i0, Prefetch& pf) {
  const int64_t K16 = K / 16 * 16;
  pf.start((M + kM - 1) / kM * (K16 / 16));
  alignas(64) float lanes[16 * 16] = {};
  alignas(64) float sums[16];
  for (int64_t m0 = 0; m0 < M; m0 += kM) {
    const int64_t mb = std::min<int64_t>(kM, M - m0);
    const TX* xs[kM];
    for (int64_t m = 0; m < mb; ++m) xs[m] = x + rows[m0 + m] * x_stride;
    with_count<kI>(ib, [&](auto IB) {
      with_count<kM>(mb, [&](auto MB) {
        constexpr int NI = decltype(IB)::value, NM = decltype(MB)::value;
        Vec16 acc[NM][NI];
        for (int m = 0; m < NM; ++m)
          for (int i = 0; i < NI; ++i) acc[m][i] = Vec16::zero();
        for (int64_t k = 0; k < K16; k += 16) {
          pf.step();
          Vec16 av[NI];
          for (int i = 0; i < NI; ++i) av[i] = Vec16::load(a + i * K + k);
          for (int m = 0; m < NM; ++m) {
            const Vec16 xv = Vec16::load(xs[m] + k);
            for (int i = 0; i < NI; ++i) acc[m][i] = fmadd(xv, av[i], acc[m][i]);
          }
        }
        for (int m = 0; m < NM; ++m)
          for (int i = 0; i < NI; ++i) acc[m][i].store(lanes + 16 * (m * kI + i));
      });
    });
    reduce16(lanes).store(sums);
    for (int64_t m = 0; m < mb; ++m)
      for (int64_t i = 0; i < ib; ++i) {
        float s = sums[m * kI + i];
        for (int64_t k = K16; k < K; ++k) s += to_float(a[i * K + k]) * to_float(xs[m][k]);
        h[(m0 + m) * r + i0 + i] = s;
      }
  }
}

// out[rows[m], c0:c0 + cb] += h[m] @ b_t[:, c0:c0 + cb] (out already at the module's offset)
template <typename TW, typename TO>
static void expand(const TW* b, int64_t n, int64_t r, int64_t c0, int64_t cb, const float* h, TO* out,
                   int64_t out_stride, const int64_t* rows, int64_t M, Prefetch& pf) {
  const int64_t vecs = cb / 16;
  pf.start((M + kM - 1) / kM * ((vecs + kV - 1) / kV) * r);
  for (int64_t m0 = 0; m0 < M; m0 += kM) {
    const int64_t mb = std::min<int64_t>(kM, M - m0);
    TO* os[kM];
    for (int64_t m = 0; m < mb; ++m) os[m] = out + rows[m0 + m] * out_stride;
    const float* hm = h + m0 * r;
    for (int64_t v0 = 0; v0 < vecs; v0 += kV) {
      const int64_t c = c0 + 16 * v0;
      with_count<kV>(std::min<int64_t>(kV, vecs - v0), [&](auto VB) {
        with_count<kM>(mb, [&](auto MB) {
          constexpr int NV = decltype(VB)::value, NM = decltype(MB)::value;
          Vec16 acc[NM][NV];
          for (int m = 0; m < NM; ++m)
            for (int v = 0; v < NV; ++v) acc[m][v] = Vec16::zero();
          for (int64_t i = 0; i < r; ++i) {
            pf.step();
            Vec16 bv[NV];
            for (int v = 0; v < NV; ++v) bv[v] = Vec16::load(b + i * n + c + 16 * v);
            for (int m = 0; m < NM; ++m) {
              const Vec16 hv = Vec16::set1(hm[m * r + i]);
              for (int v = 0; v < NV; ++v) acc[m][v] = fmadd(hv, bv[v], acc[m][v]);
            }
          }
          for (int m = 0; m < NM; ++m)
            for (int v = 0; v < NV; ++v) store16(os[m] + c + 16 * v, Vec16::load(os[m] + c + 16 * v) + acc[m][v]);
        });
      });
    }
    for (int64_t col = c0 + 16 * vecs; col < c0 + cb; ++col)  // the last n % 16 columns
      for (int64_t m = 0; m < mb; ++m) {
        float s = 0.f;
        for (int64_t i = 0; i < r; ++i) s += hm[m * r + i] * to_float(b[i * n + col]);
        os[m][col] = static_cast<TO>(to_float(os[m][col]) + s);
      }
  }
}

// out[c0:c0 + cb] += h @ b_t[:, c0:c0 + cb] for one row: b_t read row by row, runs of kRowV vectors
template <typename TW, typename TO>
static void expand_row(const TW* b, int64_t n, int64_t r, int64_t c0, int64_t cb, const float* h, TO* out,
                       Prefetch& pf) {
  const int64_t vecs = cb / 16;
  pf.start((vecs + kRowV - 1) / kRowV * r);
  for (int64_t v0 = 0; v0 < vecs; v0 += kRowV) {
    const int64_t c = c0 + 16 * v0;
    with_count<kRowV>(std::min<int64_t>(kRowV, vecs - v0), [&](auto VB) {
      constexpr int NV = decltype(VB)::value;
      Vec16 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = Vec16::zero();
      for (int64_t i = 0; i < r; ++i) {
        pf.step();
        const Vec16 hv = Vec16::set1(h[i]);
        for (int v = 0; v < NV; ++v) acc[v] = fmadd(hv, Vec16::load(b + i * n + c + 16 * v), acc[v]);
      }
      for (int v = 0; v < NV; ++v) store16(out + c + 16 * v, Vec16::load(out + c + 16 * v) + acc[v]);
    });
  }
  for (int64_t col = c0 + 16 * vecs; col < c0 + cb; ++col) {  // the last n % 16 columns
    float s = 0.f;
    for (int64_t i = 0; i < r; ++i) s += h[i] * to_float(b[i * n + col]);
    out[col] = static_cast<TO>(to_float(out[col]) + s);
  }
}

// f(T*) with T the C++ type of a float32 or bfloat16 tensor
template <typename F>
static inline void with_type(at::ScalarType t, F&& f) {
  if (t == at::kFloat)
    f(static_cast<float*>(nullptr));
  else
    f(static_cast<c10::BFloat16*>(nullptr));
}
}  // namespace lora

// One module of an adapter in a slot: out[:, offset:offset + n] += x @ a.T @ b_t
struct LoRAModule {
  at::Tensor a, b_t;  // [r, K], [r, n]: the adapter's own tensors
  int64_t offset, n, rank;
};

// One fused projection's LoRA updates in every slot, applied for the rows of the shared mapping.
struct LoRALinear {
  std::shared_ptr<LoRAMapping> mapping;
  int64_t out_features, in_features;
  std::vector<std::vector<LoRAModule>> slots;

  LoRALinear(std::shared_ptr<LoRAMapping> mapping_, int64_t num_slots, int64_t out_features_, int64_t in_features_)
      : mapping(std::move(mapping_)), out_features(out_features_), in_features(in_features_) {
    TORCH_CHECK(mapping != nullptr, "LoRALinear: mapping must be a LoRAMapping");
    TORCH_CHECK(num_slots >= 0 && out_features > 0 && in_features > 0,
                "LoRALinear: num_slots >= 0, out_features and in_features > 0");
    slots.resize(num_slots);
  }

  void check_slot(int64_t slot, const char* what) const {
    TORCH_CHECK(slot >= 0 && slot < (int64_t)slots.size(), "LoRALinear.", what, ": slot ", slot,
                " is out of range for ", slots.size(), " slots");
  }

  // modules: (a [r, in_features], b_t [r, n], out_offset); their output columns must not overlap
  void set_slot(int64_t slot, const std::vector<std::tuple<at::Tensor, at::Tensor, int64_t>>& modules) {
    check_slot(slot, "set_slot");
    std::vector<LoRAModule> held;
    for (size_t j = 0; j < modules.size(); ++j) {
      const auto& [a, b_t, offset] = modules[j];
      TORCH_CHECK(a.dim() == 2 && a.size(1) == in_features && a.size(0) > 0, "LoRALinear.set_slot: module ", j,
                  ": a must be [r, ", in_features, "], got ", a.sizes());
      TORCH_CHECK(b_t.dim() == 2 && b_t.size(0) == a.size(0), "LoRALinear.set_slot: module ", j,
                  ": b_t must be [r, n] with a's r = ", a.size(0), ", got ", b_t.sizes());
      TORCH_CHECK(offset >= 0 && offset + b_t.size(1) <= out_features, "LoRALinear.set_slot: module ", j,
                  ": out_offset ", offset, " + n ", b_t.size(1), " exceeds out_features ", out_features);
      TORCH_CHECK(a.scalar_type() == b_t.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
                  "LoRALinear.set_slot: module ", j, ": a and b_t must share a dtype, float32 or bfloat16");
      TORCH_CHECK(a.is_contiguous() && b_t.is_contiguous() && a.device().is_cpu() && b_t.device().is_cpu(),
                  "LoRALinear.set_slot: module ", j, ": a and b_t must be contiguous CPU tensors (referenced, not "
                  "copied)");
      for (const LoRAModule& o : held)  // each column gets one delta and one rounding
        TORCH_CHECK(offset + b_t.size(1) <= o.offset || o.offset + o.n <= offset, "LoRALinear.set_slot: module ",
                    j, "'s output columns overlap another module's");
      held.push_back({a, b_t, offset, b_t.size(1), a.size(0)});
    }
    slots[slot] = std::move(held);
  }

  void clear_slot(int64_t slot) {
    check_slot(slot, "clear_slot");
    slots[slot].clear();
  }

  // out [T, out_features] (unit column stride) += the updates of the rows' slots, in place; x [T, in_features]
  void apply(at::Tensor out, at::Tensor x) const {
    const LoRAMapping& map = *mapping;
    if (!map.has_lora()) return;
    TORCH_CHECK(out.dim() == 2 && out.size(0) == map.tokens && out.size(1) == out_features && out.stride(1) == 1,
                "LoRALinear.apply: out must be [", map.tokens, ", ", out_features, "] with unit column stride, got ",
                out.sizes());
    TORCH_CHECK(x.dim() == 2 && x.size(0) == map.tokens && x.size(1) == in_features, "LoRALinear.apply: x must be [",
                map.tokens, ", ", in_features, "], got ", x.sizes());
    TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "LoRALinear.apply: out and x must be float32 or bfloat16");
    check_slot(map.max_slot, "apply (the mapping's slot)");
    if (x.stride(1) != 1) x = x.contiguous();

    // the tasks: (group, module, first row of a / first output column, count); h: per group and module,
    // its rows' r values
    struct Task {
      int32_t group, module;
      int64_t first, count, h;
    };
    thread_local std::vector<Task> shrinks, expands;
    thread_local std::vector<float> h_buf;
    shrinks.clear();
    expands.clear();
    int64_t h_size = 0, work = 0;
    const int64_t K = in_features;
    for (size_t g = 0; g < map.groups.size(); ++g) {
      const auto& grp = map.groups[g];
      const auto& mods = slots[grp.slot];
      const int64_t M = grp.end - grp.begin;
      for (size_t j = 0; j < mods.size(); ++j) {
        const LoRAModule& mod = mods[j];
        for (int64_t i = 0; i < mod.rank; i += lora::kI)
          shrinks.push_back({(int32_t)g, (int32_t)j, i, std::min<int64_t>(lora::kI, mod.rank - i), h_size});
        const int64_t columns = M == 1 ? lora::kRowColumns : lora::kColumns;
        for (int64_t c = 0; c < mod.n; c += columns)
          expands.push_back({(int32_t)g, (int32_t)j, c, std::min<int64_t>(columns, mod.n - c), h_size});
        h_size += M * mod.rank;
        work += M * mod.rank * (K + mod.n);
      }
    }
    if (shrinks.empty()) return;  // the rows' slots hold no module for this projection
    if ((int64_t)h_buf.size() < h_size) h_buf.resize(h_size);
    float* h = h_buf.data();
    const Task* shrink_tasks = shrinks.data();
    const Task* expand_tasks = expands.data();

    constexpr int64_t dist = lora::kPrefetchTasks;
    const auto run_shrinks = [&](int64_t begin, int64_t end) {
      lora::with_type(x.scalar_type(), [&](auto* tx) {
        using TX = std::remove_pointer_t<decltype(tx)>;
        const TX* xp = x.data_ptr<TX>();
        for (int64_t t = begin; t < end; ++t) {
          const Task& task = shrink_tasks[t];
          const auto& grp = map.groups[task.group];
          const LoRAModule& mod = slots[grp.slot][task.module];
          lora::Prefetch pf;
          if (t + dist < end) {  // a later task's rows of a: contiguous
            const Task& next = shrink_tasks[t + dist];
            const at::Tensor& a = slots[map.groups[next.group].slot][next.module].a;
            pf.row = static_cast<const char*>(a.data_ptr()) + next.first * K * a.element_size();
            pf.row_lines = pf.lines = (next.count * K * a.element_size() + 63) / 64;
          }
          lora::with_type(mod.a.scalar_type(), [&](auto* tw) {
            using TW = std::remove_pointer_t<decltype(tw)>;
            lora::shrink(mod.a.data_ptr<TW>() + task.first * K, K, task.count, xp, x.stride(0),
                         map.rows.data() + grp.begin, grp.end - grp.begin, h + task.h, mod.rank, task.first, pf);
          });
        }
      });
    };
    const auto run_expands = [&](int64_t begin, int64_t end) {
      lora::with_type(out.scalar_type(), [&](auto* to) {
        using TO = std::remove_pointer_t<decltype(to)>;
        TO* op = out.data_ptr<TO>();
        for (int64_t t = begin; t < end; ++t) {
          const Task& task = expand_tasks[t];
          const auto& grp = map.groups[task.group];
          const LoRAModule& mod = slots[grp.slot][task.module];
          lora::Prefetch pf;
          if (t + dist < end) {  // a later task's columns of b_t: a run in each of its r rows
            const Task& next = expand_tasks[t + dist];
            const LoRAModule& nm = slots[map.groups[next.group].slot][next.module];
            const int64_t es = nm.b_t.element_size();
            pf.row = static_cast<const char*>(nm.b_t.data_ptr()) + next.first * es;
            pf.row_lines = (next.count * es + 63) / 64;
            pf.stride = nm.n * es;
            pf.lines = pf.row_lines * nm.rank;
          }
          lora::with_type(mod.b_t.scalar_type(), [&](auto* tw) {
            using TW = std::remove_pointer_t<decltype(tw)>;
            const int64_t* rows = map.rows.data() + grp.begin;
            if (grp.end - grp.begin == 1)
              lora::expand_row(mod.b_t.data_ptr<TW>(), mod.n, mod.rank, task.first, task.count, h + task.h,
                               op + rows[0] * out.stride(0) + mod.offset, pf);
            else
              lora::expand(mod.b_t.data_ptr<TW>(), mod.n, mod.rank, task.first, task.count, h + task.h,
                           op + mod.offset, out.stride(0), rows, grp.end - grp.begin, pf);
          });
        }
      });
    };
    const int64_t ns = shrinks.size(), ne = expands.size();
    if (work < lora::kParallelWork) {
      run_shrinks(0, ns);
      run_expands(0, ne);
    } else {
      at::parallel_for(0, ns, 1, run_shrinks);
      at::parallel_for(0, ne, 1, run_expands);
    }
  }
};

}  // namespace vlite

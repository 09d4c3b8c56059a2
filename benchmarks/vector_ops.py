"""Throughput of the AVX2 instructions vlite's integer kernels are made of, per core clock, on this CPU.

    python benchmarks/vector_ops.py

A kernel's instruction bound is its instruction mix over these rates: e.g. the AVX2 q4 tile kernel
(vlite/csrc/cpu/quant_linear.cpp) spends, per 256 multiply-adds of one activation row, 8 `vpmaddubsw`,
1 `vpmaddwd`, 2 FMAs and a multiply on the multiplier pipes and 8 + 2 broadcast loads. Each loop is
hand-written assembly (a compiler's loop spilled the accumulators and measured its own stores), eight
independent destinations so that latency never binds; the clock comes from a chain of dependent scalar
adds (one a cycle on every x86 core), so the figures hold under turbo and in a VM alike. No CPU
counters needed (VMs rarely expose them). x86-64 with AVX2 only.
"""

from __future__ import annotations

from torch.utils.cpp_extension import load_inline

_SRC = r"""
#include <chrono>
#include <cstdint>

static double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "cc", "memory"
#define EIGHT(OP) OP " %%ymm8, %%ymm9, %%ymm0\n" OP " %%ymm8, %%ymm9, %%ymm1\n" OP " %%ymm8, %%ymm9, %%ymm2\n" \
  OP " %%ymm8, %%ymm9, %%ymm3\n" OP " %%ymm8, %%ymm9, %%ymm4\n" OP " %%ymm8, %%ymm9, %%ymm5\n" \
  OP " %%ymm8, %%ymm9, %%ymm6\n" OP " %%ymm8, %%ymm9, %%ymm7\n"
#define FOUR_BCAST "vpbroadcastd (%1), %%ymm0\nvpbroadcastd 4(%1), %%ymm1\nvpbroadcastd 8(%1), %%ymm2\n" \
  "vpbroadcastd 12(%1), %%ymm3\n"
#define LOOP(BODY) asm volatile("vpxor %%ymm8, %%ymm8, %%ymm8\nvpxor %%ymm9, %%ymm9, %%ymm9\n1:\n" BODY \
                                "dec %0\njnz 1b" : "+r"(n) : "r"(buf) : CLOBBER)

// seconds for `iters` passes of loop `which` (8 instructions each), or of 4 dependent scalar adds (-1)
double run(int64_t which, int64_t iters) {
  alignas(32) int32_t buf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t n = iters;
  auto t0 = std::chrono::steady_clock::now();
  switch (which) {
    case -1: { uint64_t a = 0; asm volatile("1:\nadd $1, %1\nadd $1, %1\nadd $1, %1\nadd $1, %1\ndec %0\njnz 1b"
                                            : "+r"(n), "+r"(a) :: "cc"); break; }
    case 0: LOOP(EIGHT("vpaddw")); break;
    case 1: LOOP(EIGHT("vpmaddubsw")); break;
    case 2: LOOP(EIGHT("vpmaddwd")); break;
    case 3: LOOP(EIGHT("vpsignb")); break;
    case 4: LOOP(EIGHT("vfmadd231ps")); break;
    case 5: LOOP(EIGHT("vmulps")); break;
    case 6: LOOP("vcvtdq2ps %%ymm8, %%ymm0\nvcvtdq2ps %%ymm8, %%ymm1\nvcvtdq2ps %%ymm8, %%ymm2\nvcvtdq2ps %%ymm8, %%ymm3\n"
                 "vcvtdq2ps %%ymm9, %%ymm4\nvcvtdq2ps %%ymm9, %%ymm5\nvcvtdq2ps %%ymm9, %%ymm6\nvcvtdq2ps %%ymm9, %%ymm7\n");
            break;
    case 7: LOOP(FOUR_BCAST "vpbroadcastd 16(%1), %%ymm4\nvpbroadcastd 20(%1), %%ymm5\nvpbroadcastd 24(%1), %%ymm6\n"
                 "vpbroadcastd 28(%1), %%ymm7\n"); break;
    case 8: LOOP("vpmaddubsw %%ymm8, %%ymm9, %%ymm0\nvpmaddubsw %%ymm8, %%ymm9, %%ymm1\nvpmaddubsw %%ymm8, %%ymm9, %%ymm2\n"
                 "vpmaddubsw %%ymm8, %%ymm9, %%ymm3\nvpaddw %%ymm8, %%ymm9, %%ymm4\nvpaddw %%ymm8, %%ymm9, %%ymm5\n"
                 "vpaddw %%ymm8, %%ymm9, %%ymm6\nvpaddw %%ymm8, %%ymm9, %%ymm7\n"); break;
    case 9: LOOP(FOUR_BCAST "vpmaddubsw %%ymm8, %%ymm0, %%ymm4\nvpmaddubsw %%ymm8, %%ymm1, %%ymm5\n"
                 "vpmaddubsw %%ymm8, %%ymm2, %%ymm6\nvpmaddubsw %%ymm8, %%ymm3, %%ymm7\n"); break;
    case 10: LOOP("vpmaddubsw %%ymm8, %%ymm9, %%ymm0\nvpmaddubsw %%ymm8, %%ymm9, %%ymm1\nvpmaddubsw %%ymm8, %%ymm9, %%ymm2\n"
                  "vpmaddubsw %%ymm8, %%ymm9, %%ymm3\nvfmadd231ps %%ymm8, %%ymm9, %%ymm4\n"
                  "vfmadd231ps %%ymm8, %%ymm9, %%ymm5\nvfmadd231ps %%ymm8, %%ymm9, %%ymm6\n"
                  "vfmadd231ps %%ymm8, %%ymm9, %%ymm7\n"); break;
    case 11: LOOP("vpmaddubsw %%ymm8, %%ymm9, %%ymm0\nvpmaddubsw %%ymm8, %%ymm9, %%ymm1\nvpmaddubsw %%ymm8, %%ymm9, %%ymm2\n"
                  "vpmaddubsw %%ymm8, %%ymm9, %%ymm3\nvcvtdq2ps %%ymm8, %%ymm4\nvcvtdq2ps %%ymm8, %%ymm5\n"
                  "vcvtdq2ps %%ymm9, %%ymm6\nvcvtdq2ps %%ymm9, %%ymm7\n"); break;
    case 12: LOOP("vpmaddubsw %%ymm8, %%ymm9, %%ymm0\nvpmaddubsw %%ymm8, %%ymm9, %%ymm1\nvpmaddubsw %%ymm8, %%ymm9, %%ymm2\n"
                  "vpmaddubsw %%ymm8, %%ymm9, %%ymm3\nvpsignb %%ymm8, %%ymm9, %%ymm4\nvpsignb %%ymm8, %%ymm9, %%ymm5\n"
                  "vpsignb %%ymm8, %%ymm9, %%ymm6\nvpsignb %%ymm8, %%ymm9, %%ymm7\n"); break;
    case 13: LOOP(FOUR_BCAST "vpaddw %%ymm8, %%ymm9, %%ymm4\nvpaddw %%ymm8, %%ymm9, %%ymm5\nvpaddw %%ymm8, %%ymm9, %%ymm6\n"
                  "vpaddw %%ymm8, %%ymm9, %%ymm7\n"); break;
    case 14: LOOP("vpmaddubsw (%1), %%ymm9, %%ymm0\nvpmaddubsw (%1), %%ymm9, %%ymm1\nvpmaddubsw (%1), %%ymm9, %%ymm2\n"
                  "vpmaddubsw (%1), %%ymm9, %%ymm3\nvpmaddubsw (%1), %%ymm9, %%ymm4\nvpmaddubsw (%1), %%ymm9, %%ymm5\n"
                  "vpmaddubsw (%1), %%ymm9, %%ymm6\nvpmaddubsw (%1), %%ymm9, %%ymm7\n"); break;
    case 15: LOOP("vpmaddubsw %%ymm8, %%ymm9, %%ymm0\nvpmaddubsw %%ymm8, %%ymm9, %%ymm1\nvpmaddubsw %%ymm8, %%ymm9, %%ymm2\n"
                  "vpmaddubsw %%ymm8, %%ymm9, %%ymm3\nvpsrlw $4, %%ymm8, %%ymm4\nvpsrlw $4, %%ymm8, %%ymm5\n"
                  "vpsrlw $4, %%ymm9, %%ymm6\nvpsrlw $4, %%ymm9, %%ymm7\n"); break;
    case 16: LOOP("vpshufd $0, %%ymm8, %%ymm0\nvpshufd $0, %%ymm8, %%ymm1\nvpshufd $0, %%ymm8, %%ymm2\nvpshufd $0, %%ymm8, %%ymm3\n"
                  "vpaddw %%ymm8, %%ymm9, %%ymm4\nvpaddw %%ymm8, %%ymm9, %%ymm5\nvpaddw %%ymm8, %%ymm9, %%ymm6\n"
                  "vpaddw %%ymm8, %%ymm9, %%ymm7\n"); break;
    case 17: LOOP("vpshufd $0, %%ymm8, %%ymm0\nvpshufd $0, %%ymm8, %%ymm1\nvpshufd $0, %%ymm8, %%ymm2\nvpshufd $0, %%ymm8, %%ymm3\n"
                  "vpmaddubsw %%ymm8, %%ymm9, %%ymm4\nvpmaddubsw %%ymm8, %%ymm9, %%ymm5\nvpmaddubsw %%ymm8, %%ymm9, %%ymm6\n"
                  "vpmaddubsw %%ymm8, %%ymm9, %%ymm7\n"); break;
    case 18: LOOP("vpbroadcastd (%1), %%ymm0\nvpbroadcastd 4(%1), %%ymm1\nvpaddw %%ymm8, %%ymm9, %%ymm2\n"
                  "vpaddw %%ymm8, %%ymm9, %%ymm3\nvpaddw %%ymm8, %%ymm9, %%ymm4\nvpaddw %%ymm8, %%ymm9, %%ymm5\n"
                  "vpaddw %%ymm8, %%ymm9, %%ymm6\nvpaddw %%ymm8, %%ymm9, %%ymm7\n"); break;
  }
  return seconds(t0);
}
"""

LOOPS = [  # (index in run(), label)
    (0, "vpaddw"), (1, "vpmaddubsw"), (2, "vpmaddwd"), (3, "vpsignb"), (4, "vfmadd231ps"), (5, "vmulps"),
    (6, "vcvtdq2ps"), (7, "vpbroadcastd ymm, m32"), (8, "4 vpmaddubsw + 4 vpaddw"),
    (9, "4 vpbroadcastd + 4 vpmaddubsw"), (10, "4 vpmaddubsw + 4 vfmadd231ps"),
    (11, "4 vpmaddubsw + 4 vcvtdq2ps"), (12, "4 vpmaddubsw + 4 vpsignb"),
    (13, "4 vpbroadcastd + 4 vpaddw"), (14, "vpmaddubsw ymm, ymm, m256"), (15, "4 vpmaddubsw + 4 vpsrlw"),
    (16, "4 vpshufd + 4 vpaddw"), (17, "4 vpshufd + 4 vpmaddubsw"),
    (18, "2 vpbroadcastd + 6 vpaddw"),  # 1.5 cycles a pass: broadcasts beside the adds; 2: in their slots
]


def main() -> None:
    ext = load_inline("vlite_bench_vector_ops", cpp_sources=[_SRC], functions=["run"],
                      extra_cflags=["-O2", "-mavx2", "-mfma"])
    iters = 50_000_000
    ext.run(-1, iters // 10)  # warm-up: the clock up to speed
    ghz = max(4 * iters / ext.run(-1, iters) / 1e9 for _ in range(3))
    print(f"core clock (dependent scalar adds): {ghz:.2f} GHz")
    print(f"{'instructions (8 a pass, independent)':40s} per cycle, cycles a pass")
    for which, label in LOOPS:
        best = min(ext.run(which, iters) for _ in range(3))
        print(f"{label:40s} {8 * iters / best / 1e9 / ghz:5.2f}  {best * ghz * 1e9 / iters:5.2f}")


if __name__ == "__main__":
    main()

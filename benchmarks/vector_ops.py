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


def _ops(op: str, dests: range, src: str = "%%ymm8, %%ymm9") -> list[str]:
    return [f"{op} {src}, %%ymm{d}" for d in dests]


def _bcast(dests: range) -> list[str]:
    return [f"vpbroadcastd {4 * d or ''}(%1), %%ymm{d}" for d in dests]


LO, HI, ALL = range(4), range(4, 8), range(8)
# (label, the loop's 8 instructions): independent destinations ymm0-7, sources ymm8/ymm9 or buf (%1)
LOOPS: list[tuple[str, list[str]]] = [
    *[(op, _ops(op, ALL)) for op in ("vpaddw", "vpmaddubsw", "vpmaddwd", "vpsignb", "vfmadd231ps", "vmulps")],
    ("vcvtdq2ps", _ops("vcvtdq2ps", LO, "%%ymm8") + _ops("vcvtdq2ps", HI, "%%ymm9")),
    ("vpbroadcastd ymm, m32", _bcast(ALL)),
    ("4 vpmaddubsw + 4 vpaddw", _ops("vpmaddubsw", LO) + _ops("vpaddw", HI)),
    ("4 vpbroadcastd + 4 vpmaddubsw", _bcast(LO) + [f"vpmaddubsw %%ymm8, %%ymm{d - 4}, %%ymm{d}" for d in HI]),
    ("4 vpmaddubsw + 4 vfmadd231ps", _ops("vpmaddubsw", LO) + _ops("vfmadd231ps", HI)),
    ("4 vpmaddubsw + 4 vcvtdq2ps", _ops("vpmaddubsw", LO) + _ops("vcvtdq2ps", range(4, 6), "%%ymm8")
     + _ops("vcvtdq2ps", range(6, 8), "%%ymm9")),
    ("4 vpmaddubsw + 4 vpsignb", _ops("vpmaddubsw", LO) + _ops("vpsignb", HI)),
    ("4 vpbroadcastd + 4 vpaddw", _bcast(LO) + _ops("vpaddw", HI)),
    ("vpmaddubsw ymm, ymm, m256", _ops("vpmaddubsw", ALL, "(%1), %%ymm9")),
    ("4 vpmaddubsw + 4 vpsrlw", _ops("vpmaddubsw", LO) + _ops("vpsrlw", range(4, 6), "$4, %%ymm8")
     + _ops("vpsrlw", range(6, 8), "$4, %%ymm9")),
    ("4 vpshufd + 4 vpaddw", _ops("vpshufd", LO, "$0, %%ymm8") + _ops("vpaddw", HI)),
    ("4 vpshufd + 4 vpmaddubsw", _ops("vpshufd", LO, "$0, %%ymm8") + _ops("vpmaddubsw", HI)),
    # 1.5 cycles a pass: the broadcasts beside the adds; 2: in their slots
    ("2 vpbroadcastd + 6 vpaddw", _bcast(range(2)) + _ops("vpaddw", range(2, 8))),
]

_CASES = "\n".join(f'    case {i}: LOOP("{"".join(ins + chr(92) + "n" for ins in body)}"); break;'
                   for i, (_, body) in enumerate(LOOPS))

_SRC = r"""
#include <chrono>
#include <cstdint>

static double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "cc", "memory"
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
""" + _CASES + r"""
  }
  return seconds(t0);
}
"""


def main() -> None:
    ext = load_inline("vlite_bench_vector_ops", cpp_sources=[_SRC], functions=["run"],
                      extra_cflags=["-O2", "-mavx2", "-mfma"])
    iters = 50_000_000
    ext.run(-1, iters // 10)  # warm-up: the clock up to speed
    ghz = max(4 * iters / ext.run(-1, iters) / 1e9 for _ in range(3))
    print(f"core clock (dependent scalar adds): {ghz:.2f} GHz")
    print(f"{'instructions (8 a pass, independent)':40s} per cycle, cycles a pass")
    for which, (label, _) in enumerate(LOOPS):
        best = min(ext.run(which, iters) for _ in range(3))
        print(f"{label:40s} {8 * iters / best / 1e9 / ghz:5.2f}  {best * ghz * 1e9 / iters:5.2f}")


if __name__ == "__main__":
    main()

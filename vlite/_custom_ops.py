"""vlite's C++ CPU kernels (vlite/csrc/cpu): built for the CPU's instruction set, loaded on first use.

One extension module per ISA, compiled from the same sources with different flags:

    avx512    AVX-512 F/BW/VL/DQ, plus VNNI (vpdpbusd) where the CPU has it
    avx2      AVX2 + FMA + F16C (most x86 CPUs of the last decade)
    portable  no ISA flags: plain C++ that any compiler builds for any CPU (ARM included)

The best ISA the CPU has is chosen from /proc/cpuinfo; `VLITE_CPU_ISA=avx2|avx512|portable`
forces one (so an AVX-512 machine can test and benchmark the AVX2 path). Each build takes ~30 s
once (torch.utils.cpp_extension: a C++ compiler and ninja), then is cached under
~/.cache/torch_extensions. Without a compiler, or with VLITE_CPU_KERNELS=0, `load()` returns None
and the callers run plain torch code instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Optional

from vlite.config import cpu_flags

logger = logging.getLogger(__name__)

ENV_KERNELS = "VLITE_CPU_KERNELS"
ENV_ISA = "VLITE_CPU_ISA"
ISAS = ("avx512", "avx2", "portable")  # best first
_CSRC = Path(__file__).parent / "csrc" / "cpu"
_SOURCES = ("bindings.cpp", "quant_linear.cpp", "attention_chunk.cpp", "decode_attention.cpp", "layer_ops.cpp",
            "decode_layer.cpp", "vec.h", "compact_blocks.h", "gguf_tiles.cpp", "memory_bandwidth.cpp",
            "dense_linear.cpp", "ops.h", "lora.cpp", "cascade_attention.cpp", "prefill_attention.cpp",
            "gated_delta_chunk.cpp", "gated_delta.cpp", "gguf_kinds.h")
_UNITS = ("bindings.cpp", "quant_linear.cpp")  # translation units, compiled in parallel (ninja)

_REQUIRED_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}


def supported_isas(flags: Optional[str] = None) -> list[str]:
    """The ISA builds this CPU can run, best first."""
    have = set((cpu_flags() if flags is None else flags).split())
    return [isa for isa in ISAS if all(f in have for f in _REQUIRED_FLAGS[isa])]


def requested_isa() -> str:
    """The ISA to build: VLITE_CPU_ISA if set (checked against the CPU), else the best supported."""
    supported = supported_isas()
    want = os.environ.get(ENV_ISA, "").strip().lower()
    if want in ("", "auto"):
        return supported[0]
    if want not in ISAS:
        raise ValueError(f"{ENV_ISA} must be one of {('auto',) + ISAS}, got {want!r}")
    if want not in supported:
        missing = [f for f in _REQUIRED_FLAGS[want] if f not in cpu_flags().split()]
        raise ValueError(f"{ENV_ISA}={want}: this CPU lacks {missing} (it supports {supported})")
    return want


def _compile_flags(isa: str) -> list[str]:
    # no silent FMA contraction: dequantize stays exact. Hidden symbols: each ISA's module binds its
    # own kernels (two builds load into one process; only PyInit is exported, by pybind11).
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden"]
    if isa == "avx2":
        flags += ["-mavx2", "-mfma", "-mf16c"]
    elif isa == "avx512":
        flags += ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        if "avx512_vnni" in cpu_flags().split():
            flags.append("-mavx512vnni")
        if "avx512_bf16" in cpu_flags().split():  # bf16 attention scores (decode_attention.cpp)
            flags.append("-mavx512bf16")
    return flags


def _build_name(isa: str, flags: list[str]) -> str:
    import torch

    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(flags).encode() + torch.__version__.encode())
    return f"vlite_cpu_{isa}_{h.hexdigest()[:12]}"


@contextlib.contextmanager
def _build_guard(name: str) -> Iterator[None]:
    """Hold an flock of the build folder while torch builds or loads `name`: another vlite process
    waits here instead, and the kernel drops the flock of a process that dies. So while we hold it,
    torch's own lock file (which records no owner) can only be a killed build's, e.g. after Ctrl-C
    during the first start: removed, it no longer makes every later start wait on it forever."""
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory

        folder = _get_build_directory(name, verbose=False)
        os.makedirs(folder, exist_ok=True)
        guard = open(os.path.join(folder, "vlite.flock"), "a")
    except Exception:  # no fcntl (Windows) or a private torch helper gone: torch's lock alone
        yield
        return
    with guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
        except OSError:  # a file system without flock: torch's lock alone
            yield
            return
        try:
            os.remove(os.path.join(folder, "lock"))
        except FileNotFoundError:
            pass
        yield


def enabled() -> bool:
    return os.environ.get(ENV_KERNELS, "1").strip().lower() not in ("0", "false", "no", "off")


_modules: dict[str, Optional[Any]] = {}


def build(isa: str) -> Any:
    """Compile (or load from the cache) the module for `isa`; raises if that fails."""
    from torch.utils.cpp_extension import load as load_extension

    flags = _compile_flags(isa)
    name = _build_name(isa, flags)
    logger.info("loading vlite's %s CPU kernels (compiled on first use, ~40 s, then cached)", isa)
    with _build_guard(name):
        module = _load_built(name)
        if module is not None:
            return module
        src = _stable_sources(name)
        module = load_extension(name=name, sources=[str(src / u) for u in _UNITS], extra_cflags=flags,
                                extra_ldflags=["-fopenmp"], extra_include_paths=[str(src)], verbose=False)
        _mark_built(name)
        return module


def _built_marker(name: str) -> tuple[Path, Path]:
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    return folder / f"{name}.so", folder / "vlite.built"


def _mark_built(name: str) -> None:
    """Record that `name`'s module was built whole (its size), for `_load_built`."""
    try:
        library, marker = _built_marker(name)
        marker.write_text(str(library.stat().st_size))
    except Exception:
        pass


def _load_built(name: str) -> Optional[Any]:
    """The module `name` names, imported straight from its build folder where a build of it completed: its name
    holds the sources' contents, the flags and torch's version, so it is that build, whatever checkout, virtual
    environment or torch install path asks (torch's `load` reruns ninja, whose command lines hold those paths, and
    rebuilt it for each new environment: ~30 s an ISA). None: build it."""
    try:
        from torch.utils.cpp_extension import _import_module_from_library

        library, marker = _built_marker(name)
        if not marker.is_file() or marker.read_text().strip() != str(library.stat().st_size):
            return None
        return _import_module_from_library(name, str(library.parent), True)
    except Exception:  # a damaged build, a private torch helper gone: build it
        return None


def _stable_sources(name: str) -> Path:
    """The sources, copied into the build folder of `name` (which their contents name): every checkout of the
    same sources compiles the same paths, so ninja finds the cached build up to date instead of rebuilding it
    for each new clone or worktree (~30 s an ISA). Falls back to the package's own folder."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, verbose=False)) / "src"
        folder.mkdir(parents=True, exist_ok=True)
        for file in _SOURCES:
            target = folder / file
            data = (_CSRC / file).read_bytes()
            if not target.is_file() or target.read_bytes() != data:
                tmp = target.with_suffix(target.suffix + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, target)  # never a half-written source for a concurrent build to read
        return folder
    except Exception:  # a private torch helper gone, an unwritable cache: compile in place
        return _CSRC


def load(isa: Optional[str] = None) -> Optional[Any]:
    """The kernel module for `isa` (default: `requested_isa()`), or None where it cannot be built
    (disabled, no compiler, ...): callers then run their torch path.

    module.quant_linear(x [M, K], qt, scales, mins, fmt, sub, n, residual, precise, out_dtype, precise_rows)
    -> [M, N]
    (row-tiled weights, see vlite/layers/packed.py); module.dequantize(...);
    module.paged_decode_attention(query, key_cache, value_cache, block_table, seq_lens, scale);
    module.dense_linear(x, w, bias, residual) (float32, up to module.dense_max_rows() rows).

    Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention; gated_delta.cpp) on varlen batches: R requests'
    tokens concatenated in T rows, request r owning rows query_start_loc[r] .. query_start_loc[r+1]-1 (int32/int64
    [R+1], from 0, non-decreasing, to T) and state slot state_idx[r] (int32/int64 [R], distinct, < S); other slots
    are untouched, a fresh request's slot must be zeroed by the caller:
    module.gdn_conv1d(x [T, C] f32/bf16 (rows may be strided), weight [C, K] f32, conv_state [S, C, K-1] f32
    (in place: the last K-1 inputs), state_idx, query_start_loc) -> [T, C] in x's dtype, silu(causal depthwise conv);
    module.gated_delta_rule(q, k [T, Hk, Dk], v [T, Hv, Dv] (f32 or bf16, one dtype; rows and heads may be
    strided), g [T, Hv] f32 (log decay), beta [T, Hv] f32 (sigmoided), state [S, Hv, Dk, Dv] f32 (in place),
    state_idx, query_start_loc, scale, use_qk_l2norm=True, chunked_min_tokens=0) -> out [T, Hv, Dv] f32
    (Hv a multiple of Hk, Dk and Dv multiples of 16; segments of chunked_min_tokens or more tokens (0: the kernel's
    choice, 16) run the 64-token chunked form, shorter ones the recurrence);
    module.gdn_gated_rms_norm(x [N, D] f32, z [N, D] f32/bf16, weight [D] f32, eps) -> [N, D] f32.
    """
    if not enabled():
        return None
    isa = isa or requested_isa()
    if isa not in _modules:
        try:
            _modules[isa] = build(isa)
        except Exception as e:  # no compiler, no ninja, an unwritable cache ...: the torch paths work everywhere
            message = str(e).strip().splitlines()
            logger.warning("vlite's C++ CPU kernels (%s) unavailable, using torch paths: %s", isa,
                           message[-1] if message else type(e).__name__)
            _modules[isa] = None
    return _modules[isa]


def describe() -> dict[str, Any]:
    """What a benchmark report names: the CPU, its relevant flags, and the kernels in use."""
    flags = cpu_flags().split()
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16",
              "avx_vnni")
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    module = load()
    return {"cpu": model, "cpu_flags": [f for f in wanted if f in flags],
            "kernels": module.isa() if module is not None else "torch (C++ kernels unavailable)",
            "forced_isa": os.environ.get(ENV_ISA) or None}

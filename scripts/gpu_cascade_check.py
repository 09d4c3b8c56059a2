"""The GPU check of cascade attention (issue 47), for the device machine: ~2 minutes.

  1. tests     tests/attention/test_triton_cascade.py on the GPU (compiled kernels, not the interpreter)
  2. timings   plain unified_attention vs cascade_attention on all-decode steps, bf16, block size 16,
               over batch sizes x shared prefix lengths, for a Llama-3-8B attention shape (32 q / 8 kv heads,
               head dim 128) and SmolLM2-135M's (9 / 3, 64); beside each, use_cascade_attention's choice,
               so the cost model's thresholds (MIN_PREFIX_LEN, MIN_NUM_REQS, the wave count) can be set from
               measurements: `agree` counts the configurations where it picked the faster path

Run there as scripts/gpu_check.py is run (its wheels for the tests' imports), with
`PYTHONUNBUFFERED=1 python3 scripts/gpu_cascade_check.py` and timeout_s=300. Rehearse here first:
`GPU_CHECK_DRY=1 OUT=/tmp/dry .venv/bin/python scripts/gpu_cascade_check.py` (tiny shapes, interpreter).
$OUT/cascade_check.log (everything) and $OUT/cascade_results.json (every figure) come back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", "/tmp/gpu_cascade_out"))
DRY = os.environ.get("GPU_CHECK_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
else:
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # (query heads, kv heads, head dim)
BATCHES = (2, 4) if DRY else (4, 8, 16, 32, 64, 128, 256)
PREFIXES = (32,) if DRY else (256, 1024, 4096)
BLOCK_SIZE = 16
_log = None


def log(*parts: object) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    _log.write(line + "\n")
    _log.flush()


def bench_ms(fn) -> float:
    """Median milliseconds of fn() (triton's do_bench on a GPU; one timed call in the rehearsal)."""
    if DRY:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def decode_step(num_reqs: int, prefix_len: int, hq: int, hkv: int, head_dim: int, device: str,
                dtype: torch.dtype, gen: torch.Generator) -> dict:
    """A paged cache whose first prefix_len / BLOCK_SIZE blocks every row shares, then 16..256 own tokens
    per request (4..16 in the rehearsal), one decode query each."""
    own = torch.randint(4 if DRY else 16, (16 if DRY else 256) + 1, (num_reqs,), generator=gen)
    seq_lens = prefix_len + own
    prefix_blocks = prefix_len // BLOCK_SIZE
    need = (-(-seq_lens // BLOCK_SIZE)).tolist()
    width = max(need)
    num_blocks = prefix_blocks + sum(n - prefix_blocks for n in need)
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    table[:, :prefix_blocks] = ids[:prefix_blocks].int()
    used = prefix_blocks
    for r, n in enumerate(need):
        table[r, prefix_blocks:n] = ids[used:used + n - prefix_blocks].int()
        used += n - prefix_blocks
    cache = torch.randn(2, hkv, num_blocks, BLOCK_SIZE, head_dim, generator=gen).to(device=device, dtype=dtype)
    return dict(query=torch.randn(num_reqs, hq, head_dim, generator=gen).to(device=device, dtype=dtype),
                cache=cache, block_table=table.to(device),
                qsl=torch.arange(num_reqs + 1, dtype=torch.int32, device=device),
                seq_lens=seq_lens.to(device=device, dtype=torch.int32))


def timings() -> dict:
    from vlite.attention.ops.triton_cascade import cascade_attention, use_cascade_attention
    from vlite.attention.ops.triton_unified_attention import unified_attention

    device = "cpu" if DRY else "cuda"
    dtype = torch.float16 if DRY else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    gen = torch.Generator().manual_seed(0)
    rows, agree = [], 0
    for name, (hq, hkv, head_dim) in SHAPES.items():
        for prefix_len in PREFIXES:
            for num_reqs in BATCHES:
                s = decode_step(num_reqs, prefix_len, hq, hkv, head_dim, device, dtype, gen)
                args = (s["query"], s["cache"][0], s["cache"][1], s["block_table"], s["qsl"], s["seq_lens"], 1)
                scale = head_dim ** -0.5
                plain_out = torch.empty_like(s["query"])
                cascade_out = torch.empty_like(s["query"])
                plain = bench_ms(lambda: unified_attention(*args, scale, out=plain_out))
                cascade = bench_ms(lambda: cascade_attention(*args, prefix_len, scale, out=cascade_out))
                chosen = use_cascade_attention(prefix_len, [1] * num_reqs, hq, hkv, 0)
                agree += chosen == (cascade < plain)
                diff = float((plain_out.float() - cascade_out.float()).abs().max())
                row = dict(shape=name, num_reqs=num_reqs, prefix_len=prefix_len, plain_us=round(plain * 1e3, 1),
                           cascade_us=round(cascade * 1e3, 1), speedup=round(plain / cascade, 3),
                           use_cascade=chosen, max_abs_diff=diff)
                rows.append(row)
                log(" ".join(f"{k}={v}" for k, v in row.items()))
                del s
    log(f"use_cascade_attention picked the faster path in {agree} of {len(rows)} configurations")
    return {"rows": rows, "agree": agree, "configurations": len(rows)}


def main() -> int:
    global _log
    OUT.mkdir(parents=True, exist_ok=True)
    _log = open(OUT / "cascade_check.log", "w")
    results: dict = {"dry": DRY}
    if not DRY:
        log(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
    start = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5",
           "tests/attention/test_triton_cascade.py"]
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=150)
    log(p.stdout.rstrip()[-8000:])
    results["tests"] = {"rc": p.returncode, "seconds": round(time.time() - start, 1)}
    try:
        results["timings"] = timings()
    except Exception:  # the tests' results must still come back
        import traceback

        log(traceback.format_exc())
        results["timings"] = {"error": traceback.format_exc()[-2000:]}
    (OUT / "cascade_results.json").write_text(json.dumps(results, indent=1))
    return 0 if results["tests"]["rc"] == 0 and "error" not in results["timings"] else 1


if __name__ == "__main__":
    sys.exit(main())

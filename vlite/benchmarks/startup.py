"""`vlite bench startup`: process start to first token, and the memory it takes, as a user meets them.

Each run is a fresh Python process that times `from vlite import LLM, SamplingParams` (torch's import
included), `LLM(model)` (weights, tokenizer, KV pool) and one 1-token greedy `generate`, and reads its own
VmRSS and VmHWM (peak RSS) from /proc at the end. The first run starts with an empty model cache
(`VLITE_CACHE_DIR`: a temporary folder), so it is the "first time" a file is seen; the next `--num-iters`
runs read that cache ("cached"). The C++ kernels are built (or found built) before the first run, so no run
counts a compile. llama.cpp's figure to set beside it is llama-server's load: start to `/health` ok.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from vlite.benchmarks.utils import add_output_args, jsonable_args, write_json
from vlite.entrypoints.cli.args import positive_int

HELP = "process start to first token (import, LLM(), first token) and peak RSS, first time and cached"
DESCRIPTION = ("Start-up of a model as a user meets it: fresh processes timing the import, LLM(model) and one "
               "1-token generate, with their peak RSS; the first with an empty model cache, then --num-iters "
               "reading it.")

# One run: timings (s) and memory (bytes) as a JSON line on stdout.
PROBE = r"""
import json, re, sys, time
t0 = time.perf_counter()
from vlite import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[2]))
t2 = time.perf_counter()
llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
t3 = time.perf_counter()
status = open("/proc/self/status").read()
kb = lambda key: int(re.search(key + r":\s+(\d+) kB", status).group(1)) * 1024
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1, "first_token_s": t3 - t2, "total_s": t3 - t0,
                  "rss_bytes": kb("VmRSS"), "peak_rss_bytes": kb("VmHWM")}))
"""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark options")
    group.add_argument("--model", default=None, help="GGUF file, folder or hub id (default: the bundled model)")
    group.add_argument("--max-model-len", type=positive_int, default=2048, metavar="N",
                       help="the engine's max_model_len (default: %(default)s)")
    group.add_argument("--num-iters", type=positive_int, default=3, metavar="N",
                       help="cached runs after the first (default: %(default)s)")
    add_output_args(parser, profile=False)


def _run(model: str, max_model_len: int, cache_dir: str) -> dict[str, Any]:
    env = {**os.environ, "VLITE_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, "-c", PROBE, model, str(max_model_len)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the start-up run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_startup(model: str | None, max_model_len: int = 2048, num_iters: int = 3) -> dict[str, Any]:
    """{"first": one run, "cached": [runs]} for `model` (None: the bundled one), each a dict of PROBE's figures."""
    from vlite import _custom_ops
    from vlite.model_loader import resolve_model

    _custom_ops.load()  # built (or found) now: no run counts a compile
    resolved = resolve_model(model)
    path = str(resolved.gguf_file or resolved.path)
    with tempfile.TemporaryDirectory(prefix="vlite-bench-startup-") as cache_dir:
        first = _run(path, max_model_len, cache_dir)
        cached = [_run(path, max_model_len, cache_dir) for _ in range(num_iters)]
    return {"model": path, "max_model_len": max_model_len, "first": first, "cached": cached}


def _line(label: str, r: dict[str, Any]) -> str:
    return (f"{label:<12} {r['total_s']:6.2f} s  (import {r['import_s']:.2f} s, LLM() {r['llm_s']:.2f} s, first token "
            f"{r['first_token_s']:.2f} s)  peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB")


def main(ns: argparse.Namespace) -> int:
    results = run_startup(ns.model, ns.max_model_len, ns.num_iters)
    print(f"start-up to first token: {results['model']}")
    print(_line("first time", results["first"]))
    for i, r in enumerate(results["cached"]):
        print(_line(f"cached {i + 1}", r))
    write_json(ns.output_json, {"args": jsonable_args(ns), **results})
    return 0

"""`vlite bench prefix-cache --restart`: time to first token of a long document prompt computed, then served
from the KV store (--kv-offload-dir) by a fresh engine in a new process, as after a server restart.

    process 1: engine with the store; warm-up prompts; the document, cold (computed; its blocks are
               stored); the engine shut down (pending writes finish)
    process 2: a new engine on the same directory; warm-up prompts; the same document (its blocks load
               from the store, only the tokens after the last full block are computed)

Without --kv-offload-dir a temporary directory is used and removed afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from vlite.benchmarks.utils import hardware_report, jsonable_args, print_block, print_hardware, write_json

# Warm-up prompts (kernels, allocator, threads) before the measured request, each a fresh random prompt.
WARMUP_PROMPT_LEN = 256


def _phase(ns: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One engine's life, in a process of its own: warm up, time the document, shut down."""
    from vlite.benchmarks.datasets import allowed_token_ids, random_requests, tokenizer_special_ids
    from vlite.benchmarks.prefix_cache import timed_request
    from vlite.entrypoints.cli.engine import load_engine

    engine = load_engine(ns)
    pool = allowed_token_ids(engine.input_processor.vocab_size, tokenizer_special_ids(engine.get_tokenizer()))

    def prompt(length: int, seed: int) -> list[int]:
        return random_requests(1, length, 1, 0.0, seed, token_ids=pool)[0].prompt_token_ids

    for i in range(max(1, ns.num_iters_warmup)):  # other prompts in each phase: no hit on the document
        seed = ns.seed * 100003 + 1 + i + (0 if tag == "cold" else 1000)
        timed_request(engine, f"{tag}-warmup{i}", prompt(WARMUP_PROMPT_LEN, seed), ns.output_len)
    ttft, cached = timed_request(engine, f"{tag}-document", prompt(ns.prompt_len, ns.seed * 100003), ns.output_len)
    metrics = engine.get_metrics()
    result = {"ttft_s": ttft, "cached_tokens": cached, "hardware": hardware_report(engine),
              "model": engine.resolved_model.name, "dtype": engine.model_config.torch_dtype_name,
              "external_prefix_cache_hits": metrics["external_prefix_cache_hits"]}
    engine.engine_core.shutdown()  # the stored blocks are on disk before the process ends
    return result


def _in_new_process(ns: argparse.Namespace, tag: str) -> dict[str, Any]:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_phase, ns, tag).result()


def run_restart(ns: argparse.Namespace) -> dict[str, Any]:
    temporary = ns.kv_offload_dir is None
    if temporary:
        ns.kv_offload_dir = tempfile.mkdtemp(prefix="vlite-kv-bench-")
    try:
        cold = _in_new_process(ns, "cold")
        restarted = _in_new_process(ns, "restarted")
    finally:
        if temporary:
            shutil.rmtree(ns.kv_offload_dir, ignore_errors=True)
            ns.kv_offload_dir = None
    results: dict[str, Any] = {
        "benchmark": "prefix-cache-restart",
        "model": cold["model"],
        "dtype": cold["dtype"],
        "args": jsonable_args(ns),
        "hardware": cold["hardware"],
        "recompute_ttft_ms": 1e3 * cold["ttft_s"],
        "restart_ttft_ms": 1e3 * restarted["ttft_s"],
        "ratio": restarted["ttft_s"] / cold["ttft_s"],
        "restart_cached_tokens": restarted["cached_tokens"],
        "restart_external_hits": restarted["external_prefix_cache_hits"],
    }
    print_hardware(results["hardware"])
    print_block(f"vlite prefix cache across a restart ({results['model']}, {results['dtype']}, KV store)", [
        ("Prompt tokens", ns.prompt_len),
        ("TTFT computed, first engine (ms)", results["recompute_ttft_ms"]),
        ("TTFT after restart, from the store (ms)", results["restart_ttft_ms"]),
        ("Ratio (after restart / computed)", results["ratio"]),
        ("Prompt tokens loaded from the store", results["restart_external_hits"]),
    ])
    write_json(ns.output_json, results)
    return results

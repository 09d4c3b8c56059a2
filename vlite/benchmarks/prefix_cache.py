"""`vlite bench prefix-cache`: time to first token of a long prompt, cold and then from the prefix cache.

Each iteration draws a fresh random prompt of `--prompt-len` tokens and runs it twice, one after
the other, each alone in the engine: the first request computes the whole prompt; the second,
identical one finds all its full blocks in the prefix cache and computes only the rest (at least
the last token, whose logits it samples from). TTFT is measured from `add_request` to the
`step()` that returns the first token. Run it again with `--no-enable-prefix-caching` for the
contrast: both requests then compute the whole prompt. `--restart`: the second request is served by a
new engine in a new process from the KV store (--kv-offload-dir), see prefix_cache_restart.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from vlite.benchmarks.datasets import allowed_token_ids, random_requests, tokenizer_special_ids
from vlite.benchmarks.utils import (add_output_args, finish_profiler, hardware_report, jsonable_args, print_block,
                                    print_hardware, setup_profiler, write_json)
from vlite.entrypoints.cli.args import add_common_args, add_engine_args, non_negative_int, positive_int
from vlite.entrypoints.cli.engine import load_engine

HELP = "TTFT of a long prompt, first (cold) vs again (prefix-cache hit, or --restart: from the KV store)"
DESCRIPTION = ("Time to first token of a --prompt-len token prompt, the first time and the second time (an "
               "identical request served from the prefix cache), and their ratio. Run it with "
               "--no-enable-prefix-caching for the contrast, or with --restart (e.g. --prompt-len 4000) for the "
               "second request in a fresh engine process served from the --kv-offload-dir store.")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark options")
    group.add_argument("--prompt-len", type=positive_int, default=1000, metavar="N",
                       help="prompt tokens (default: %(default)s)")
    group.add_argument("--output-len", type=positive_int, default=1, metavar="N",
                       help="tokens generated per request (default: %(default)s)")
    group.add_argument("--num-iters", type=positive_int, default=3, metavar="N",
                       help="measured prompt pairs, each with a fresh prompt (default: %(default)s)")
    group.add_argument("--num-iters-warmup", type=non_negative_int, default=1, metavar="N",
                       help="prompt pairs run first and not measured (default: %(default)s)")
    group.add_argument("--restart", action="store_true",
                       help="time the prompt computed by one engine, then in a new engine process loaded from "
                            "the KV store (--kv-offload-dir; default: a temporary directory)")
    add_output_args(parser)
    add_common_args(parser)
    add_engine_args(parser)


def timed_request(engine: Any, request_id: str, prompt: list[int], output_len: int) -> tuple[float, int]:
    """Run one request alone; (TTFT in seconds, prompt tokens served from the prefix cache)."""
    from vlite.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ttft = None
    cached = 0
    t0 = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
                cached = out.num_cached_tokens
    if ttft is None:
        raise RuntimeError(f"request {request_id} produced no token")
    return ttft, cached


def run_pair(engine: Any, prompt: list[int], output_len: int, tag: str) -> dict[str, float]:
    first, first_cached = timed_request(engine, f"{tag}-first", prompt, output_len)
    second, second_cached = timed_request(engine, f"{tag}-second", prompt, output_len)
    return {"first_ttft_s": first, "second_ttft_s": second, "first_cached_tokens": first_cached,
            "second_cached_tokens": second_cached}


def run_prefix_cache(ns: argparse.Namespace) -> dict[str, Any]:
    from vlite import profiler

    setup_profiler(ns)
    engine = load_engine(ns)
    pool = allowed_token_ids(engine.input_processor.vocab_size, tokenizer_special_ids(engine.get_tokenizer()))

    def prompt_for(iteration: int) -> list[int]:
        return random_requests(1, ns.prompt_len, 1, 0.0, ns.seed * 100003 + iteration,
                               token_ids=pool)[0].prompt_token_ids

    for i in range(ns.num_iters_warmup):
        run_pair(engine, prompt_for(-1 - i), ns.output_len, f"warmup{i}")
    engine.reset_prefix_cache()
    profiler.reset()
    prompts = [prompt_for(i) for i in range(ns.num_iters)]
    pairs = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        pairs.append(run_pair(engine, prompt, ns.output_len, f"iter{i}"))
    wall = time.perf_counter() - start
    first = statistics.median(p["first_ttft_s"] for p in pairs)
    second = statistics.median(p["second_ttft_s"] for p in pairs)
    results: dict[str, Any] = {
        "benchmark": "prefix-cache",
        "model": engine.resolved_model.name,
        "dtype": engine.model_config.torch_dtype_name,
        "enable_prefix_caching": ns.enable_prefix_caching,
        "args": jsonable_args(ns),
        "hardware": hardware_report(engine),
        "pairs": pairs,
        "first_ttft_ms": 1e3 * first,
        "second_ttft_ms": 1e3 * second,
        "speedup": first / second if second else float("nan"),
        "second_cached_tokens": min(p["second_cached_tokens"] for p in pairs),
    }
    caching = "on" if ns.enable_prefix_caching else "off"
    print_hardware(results["hardware"])
    print_block(f"vlite prefix cache ({results['model']}, {results['dtype']}, prefix caching {caching})", [
        ("Prompt tokens", ns.prompt_len),
        ("Iterations (medians below)", ns.num_iters),
        ("TTFT first request (ms)", results["first_ttft_ms"]),
        ("TTFT second, identical request (ms)", results["second_ttft_ms"]),
        ("Speedup (first / second)", results["speedup"]),
        ("Cached prompt tokens of the second", results["second_cached_tokens"]),
    ])
    finish_profiler(results, wall)
    write_json(ns.output_json, results)
    return results


def main(ns: argparse.Namespace) -> int:
    if ns.restart:
        from vlite.benchmarks.prefix_cache_restart import run_restart

        run_restart(ns)
    else:
        run_prefix_cache(ns)
    return 0

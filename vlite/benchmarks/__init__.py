"""`vlite bench <name>`: benchmarks, after vLLM's `vllm bench`.

One module per benchmark. Each module provides

    HELP, DESCRIPTION        the subcommand's one-line help and its description
    add_cli_args(parser)     its flags (the model benchmarks reuse the engine flags of `vlite generate`)
    main(ns) -> int          run it from the parsed flags; prints a report, returns the exit status

and a plain function (`run_throughput`, `run_latency`, ...) that does the work and returns the
results as a dict, so tests and scripts can call it without the command line.

    throughput    offline: many requests in one LLM.generate; requests/s and tokens/s (vs transformers)
    latency       one batch through LLMEngine.step(): time to first token, inter-token latency, end to end
    prefix-cache  time to first token of a long prompt, cold and then again from the prefix cache
    scheduler     the pure-Python Scheduler + KVCacheManager alone, with a fake model: µs per step
    serve         online: streamed requests against a running `vlite serve` at a request rate; TTFT, TPOT,
                  ITL, E2E percentiles and throughput (vllm bench serve's report)
    startup       fresh processes: import, LLM(model), first token and peak RSS, first time and cached
"""

from __future__ import annotations

import importlib
from typing import Any

# Subcommand name -> module.
BENCHMARKS: dict[str, str] = {
    "throughput": "vlite.benchmarks.throughput",
    "latency": "vlite.benchmarks.latency",
    "prefix-cache": "vlite.benchmarks.prefix_cache",
    "scheduler": "vlite.benchmarks.scheduler",
    "serve": "vlite.benchmarks.serve",
    "startup": "vlite.benchmarks.startup",
}


def add_bench_parser(subparsers: Any) -> None:
    """Add `bench` with one sub-subcommand per benchmark to the `vlite` subparsers."""
    parser = subparsers.add_parser(
        "bench", help="benchmark vlite: " + ", ".join(BENCHMARKS),
        description="Benchmarks (the convention of `vllm bench`). Each prints a report; --output-json saves it.")
    bench_subparsers = parser.add_subparsers(dest="bench_name", metavar="BENCHMARK", required=True,
                                             help="the benchmark to run")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        sub = bench_subparsers.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_cli_args(sub)
        sub.set_defaults(handler=module.main)

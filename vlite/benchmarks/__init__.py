"""`vlite bench <name>`: benchmarks, after vLLM's `vllm bench`.

One module per benchmark (`serve`: a package, its command in serve/command.py). Each module provides

    HELP, DESCRIPTION        the subcommand's one-line help and its description
    add_cli_args(parser)     its flags (the model benchmarks reuse the engine flags of `vlite generate`,
                             and every benchmark the validators of vlite/entrypoints/cli/args.py)
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
    embed         a pooling model: sentences/s of LLM.embed beside SentenceTransformer.encode
    lora          LoRA adapters beside the base model: mixed-adapter batch throughput, single-stream decode
"""

from __future__ import annotations

# Subcommand name -> module (`vlite bench <name>`; the parser is built in vlite/entrypoints/cli/bench.py).
BENCHMARKS: dict[str, str] = {
    "throughput": "vlite.benchmarks.throughput",
    "latency": "vlite.benchmarks.latency",
    "prefix-cache": "vlite.benchmarks.prefix_cache",
    "scheduler": "vlite.benchmarks.scheduler",
    "serve": "vlite.benchmarks.serve.command",
    "startup": "vlite.benchmarks.startup",
    "embed": "vlite.benchmarks.embed",
    "lora": "vlite.benchmarks.lora",
}

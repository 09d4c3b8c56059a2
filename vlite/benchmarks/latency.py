"""`vlite bench latency`: per-request latencies of one batch, from `LLMEngine.step()` timestamps.

Each iteration adds `--batch-size` requests of random token ids (`--input-len` tokens, exactly
`--output-len` generated, `ignore_eos=True`) at time t0, then steps the engine until they finish,
stamping each new token with the time its `step()` returned. Per request:

    TTFT       first token's stamp - t0 (queueing inside the batch + prefill + first sample)
    ITL        gaps between consecutive token stamps (one decode step each)
    E2E        last token's stamp - t0
    batch      time until the whole batch finished (vllm bench latency's "latency")

At batch size 1, single-stream decode speed = 1 / mean(ITL). Iterations use fresh prompts (and the
prefix cache is reset between them), so no iteration reuses another's KV cache.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from vlite.benchmarks.bandwidth import decode_bandwidth_report, format_bandwidth
from vlite.benchmarks.datasets import allowed_token_ids, copy_requests, random_requests, tokenizer_special_ids
from vlite.benchmarks.utils import (
    add_output_args,
    describe,
    finish_profiler,
    hardware_report,
    jsonable_args,
    print_hardware,
    setup_profiler,
    spec_decoding_report,
    spec_decoding_rows,
    write_json,
)
from vlite.entrypoints.cli.args import add_common_args, add_engine_args, non_negative_int, positive_int
from vlite.entrypoints.cli.engine import load_engine

HELP = "one batch through LLMEngine.step(): TTFT, inter-token latency p50/p90/p99, end-to-end latency"
DESCRIPTION = ("Latency of one batch of --batch-size random requests, measured from LLMEngine.step() timestamps: "
               "time to first token, inter-token (per decode step) latency percentiles, end-to-end latency, and "
               "at batch size 1 the single-stream decode tokens/s.")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark options")
    group.add_argument("--batch-size", type=positive_int, default=8, metavar="N",
                       help="requests in the batch (default: %(default)s)")
    group.add_argument("--input-len", type=positive_int, default=32, metavar="N",
                       help="prompt tokens per request (default: %(default)s)")
    group.add_argument("--output-len", type=positive_int, default=128, metavar="N",
                       help="tokens generated per request (default: %(default)s)")
    group.add_argument("--num-iters", type=positive_int, default=5, metavar="N",
                       help="measured iterations (default: %(default)s)")
    group.add_argument("--num-iters-warmup", type=non_negative_int, default=1, metavar="N",
                       help="iterations run first and not measured (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, metavar="T",
                       help="sampling temperature; 0 is greedy (default: %(default)s)")
    group.add_argument("--dataset", default="random", choices=["random", "copy"],
                       help="random token-id prompts of --input-len (exactly --output-len tokens generated), or "
                            "chat prompts whose answers copy spans of the prompt (at most --output-len tokens, "
                            "to the model's end of answer; see vlite.benchmarks.datasets) (default: %(default)s)")
    add_output_args(parser)
    add_common_args(parser)
    add_engine_args(parser)


def run_batch(engine: Any, prompts: list[list[int]], output_len: int, temperature: float = 0.0,
              tag: str = "lat", ignore_eos: bool = True) -> dict[str, Any]:
    """Run one batch to completion; per-request token timestamps relative to t0 (seconds)."""
    from vlite.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=ignore_eos,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            if out.request_id in stamps:
                stamps[out.request_id].extend([now] * len(out.outputs[0].token_ids))
    batch = time.perf_counter() - t0
    return {"stamps": [stamps[rid] for rid in ids], "batch_s": batch}


def latency_stats(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT, ITL, E2E (ms) over every request of every batch, and batch latency (ms)."""
    ttft, itl, e2e = [], [], []
    for b in batches:
        for stamps in b["stamps"]:
            if not stamps:
                continue
            ttft.append(1e3 * stamps[0])
            e2e.append(1e3 * stamps[-1])
            itl.extend(1e3 * (t1 - t0) for t0, t1 in zip(stamps, stamps[1:]))
    return {
        "ttft_ms": describe(ttft),
        "itl_ms": describe(itl),
        "e2e_ms": describe(e2e),
        "batch_ms": describe([1e3 * b["batch_s"] for b in batches]),
    }


def format_table(stats: dict[str, Any]) -> str:
    rows = [("time to first token (TTFT)", "ttft_ms"), ("inter-token latency (ITL)", "itl_ms"),
            ("end-to-end latency (E2E)", "e2e_ms"), ("batch latency", "batch_ms")]
    lines = [f"{'metric (ms)':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'count':>8}"]
    for label, key in rows:
        d = stats[key]
        lines.append(f"{label:<28}{d['mean']:>10.2f}{d['p50']:>10.2f}{d['p90']:>10.2f}{d['p99']:>10.2f}"
                     f"{int(d['count']):>8}")
    return "\n".join(lines)


def run_latency(ns: argparse.Namespace) -> dict[str, Any]:
    from vlite import profiler

    setup_profiler(ns)
    engine = load_engine(ns)
    pool = allowed_token_ids(engine.input_processor.vocab_size, tokenizer_special_ids(engine.get_tokenizer()))

    copy = ns.dataset == "copy"

    def prompts_for(iteration: int) -> list[list[int]]:
        seed = ns.seed * 100003 + iteration
        if copy:
            reqs = copy_requests(engine.get_tokenizer(), ns.batch_size * (abs(iteration) + 1), ns.output_len, seed)
            reqs = reqs[-ns.batch_size:]  # each iteration's own: the kinds of prompt take turns
        else:
            reqs = random_requests(ns.batch_size, ns.input_len, 1, 0.0, seed, token_ids=pool)
        return [r.prompt_token_ids for r in reqs]

    for i in range(ns.num_iters_warmup):
        run_batch(engine, prompts_for(-1 - i), ns.output_len, ns.temperature, tag=f"warmup{i}", ignore_eos=not copy)
        engine.reset_prefix_cache()
    profiler.reset()
    batches = []
    wall = 0.0
    spec_before = engine.engine_core.make_stats().spec_decoding
    for i, prompts in enumerate([prompts_for(i) for i in range(ns.num_iters)]):
        b = run_batch(engine, prompts, ns.output_len, ns.temperature, tag=f"iter{i}", ignore_eos=not copy)
        wall += b["batch_s"]
        batches.append(b)
        engine.reset_prefix_cache()
    spec = spec_decoding_report(spec_before, engine.engine_core.make_stats().spec_decoding)

    stats = latency_stats(batches)
    results: dict[str, Any] = {
        "benchmark": "latency",
        "model": engine.resolved_model.name,
        "dtype": engine.model_config.torch_dtype_name,
        "args": jsonable_args(ns),
        "hardware": hardware_report(engine),
        **stats,
        "output_tokens_per_s": (sum(len(s) for b in batches for s in b["stamps"]) / len(batches)
                                / (stats["batch_ms"]["mean"] / 1e3)),
    }
    if spec is not None:
        results["spec_decoding"] = spec
    if ns.batch_size == 1 and stats["itl_ms"]["count"]:
        results["single_stream_decode_tokens_per_s"] = 1e3 / stats["itl_ms"]["mean"]
        model = getattr(getattr(engine.engine_core, "model_runner", None), "model", None)
        if model is not None and spec is None:  # in-process model, one token a step: decode as a memory pass
            results["bandwidth"] = decode_bandwidth_report(model, results["single_stream_decode_tokens_per_s"])

    print(f"vlite latency: {results['model']} ({results['dtype']}), batch {ns.batch_size}, input {ns.input_len}, "
          f"output {ns.output_len}, {ns.num_iters} iterations ({ns.num_iters_warmup} warmup)")
    print_hardware(results["hardware"])
    print(format_table(stats))
    print(f"output throughput of the batch: {results['output_tokens_per_s']:.2f} tok/s")
    if "single_stream_decode_tokens_per_s" in results:
        print(f"single-stream decode: {results['single_stream_decode_tokens_per_s']:.2f} tok/s (1 / mean ITL)")
    if "bandwidth" in results:
        print(format_bandwidth(results["bandwidth"]))
    for label, value in spec_decoding_rows(spec):
        print(f"{label}: {value:.3f}" if isinstance(value, float) else f"{label}: {value}")
    finish_profiler(results, wall)
    write_json(ns.output_json, results)
    return results


def main(ns: argparse.Namespace) -> int:
    run_latency(ns)
    return 0

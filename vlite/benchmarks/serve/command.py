"""`vlite bench serve` as a command: its flags, and the run from them (what it measures: see the package)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import sys
import time
from typing import Any, Optional

from vlite.benchmarks.datasets import BenchRequest, load_json_dataset, random_requests, summarize
from vlite.benchmarks.serve.client import (RequestRecord, api_key_from, fetch_models, headers_for, run_requests,
                                           stream_request)
from vlite.benchmarks.serve.report import (DEFAULT_PERCENTILES, format_report, plot_results, require_matplotlib,
                                           scrape_spec_counters, spec_decoding_summary, summarize_records)
from vlite.benchmarks.serve.workload import (FALLBACK_TOKEN_IDS, arrival_times, build_payload, load_vocabulary,
                                             prompt_texts, tokenizer_model_for)
from vlite.benchmarks.utils import add_dataset_args, jsonable_args, write_json
from vlite.entrypoints.cli.args import non_negative_float, parse_number, positive_float, positive_int

HELP = "online serving against a running `vlite serve`: TTFT, TPOT, ITL, E2E and throughput under load"
DESCRIPTION = ("Online serving benchmark (after `vllm bench serve`): streams requests to a running OpenAI-compatible "
               "server (`vlite serve`) at --request-rate requests/s (Poisson arrivals; inf = all at once), at most "
               "--max-concurrency in flight, and reports request and token throughput and the mean, median, p90 "
               "and p99 of time to first token, time per output token, inter-token latency and end-to-end "
               "latency. Random token-id prompts (as `vlite bench throughput`) or --dataset-path.")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 64
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


# --------------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------------

def request_rate(text: str) -> float:
    """A positive number of requests/s, or inf."""
    value = parse_number(text, float, "rate", "; a number of requests/s or inf")
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def percentile_list(text: str) -> tuple[float, ...]:
    """Comma-separated percentiles, each in (0, 100)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid percentiles {text!r}; e.g. 90,99") from None
    if not values or not all(0 < v < 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100), got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument("--base-url", default=DEFAULT_BASE_URL, metavar="URL",
                       help="the server's address (default: %(default)s)")
    group.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS,
                       help="the API route to benchmark (default: %(default)s); chat requests send the random "
                            "prompts as text (decoded by the tokenizer or the server's /detokenize)")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="sent as `Authorization: Bearer KEY` (default: $VLITE_API_KEY, else $OPENAI_API_KEY)")
    group.add_argument("--model", default=None, metavar="NAME",
                       help="the `model` field of the requests (default: the first id of the server's /v1/models)")
    group.add_argument("--tokenizer", default=None, metavar="MODEL",
                       help="where the random prompts' vocabulary comes from: a model path or repo id, as `vlite "
                            "serve` takes (default: the served model if it is the bundled default or a local path, "
                            f"else token ids {FALLBACK_TOKEN_IDS.start}..{FALLBACK_TOKEN_IDS.stop - 1})")
    group.add_argument("--request-timeout", type=positive_float, default=600.0, metavar="S",
                       help="give up on a request after S seconds without progress (default: %(default)s)")
    group.add_argument("--ready-timeout", type=non_negative_float, default=0.0, metavar="S",
                       help="wait up to S seconds for the server to answer /v1/models (e.g. while it loads the "
                            "model); 0: fail at once (default: %(default)s)")
    group = add_dataset_args(parser, DEFAULT_NUM_PROMPTS)
    group.add_argument("--seed", type=int, default=0, metavar="SEED",
                       help="seed of the random prompts and of the arrival times (default: %(default)s)")
    group = parser.add_argument_group("traffic options")
    group.add_argument("--request-rate", type=request_rate, default=math.inf, metavar="R",
                       help="requests per second, arriving as a Poisson process; inf sends them all at once "
                            "(default: %(default)s)")
    group.add_argument("--burstiness", type=positive_float, default=1.0, metavar="B",
                       help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, below 1 "
                            "burstier, above 1 more even (default: %(default)s)")
    group.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                       help="most requests in flight at once; others wait to be sent (default: no limit)")
    group = parser.add_argument_group("request options")
    group.add_argument("--temperature", type=float, default=None, metavar="T",
                       help="sampling temperature sent with each request (default: none sent, the server's)")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="send ignore_eos so every request generates exactly its output length (default: on)")
    group.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="send one short untimed request first, which also checks the setup (default: on)")
    group = parser.add_argument_group("report options")
    group.add_argument("--metric-percentiles", type=percentile_list, default=DEFAULT_PERCENTILES, metavar="P,...",
                       help="percentiles reported besides mean and median (default: 90,99)")
    group.add_argument("--save-result", action="store_true",
                       help="save config, summary and per-request records as JSON (see --result-dir, "
                            "--result-filename)")
    group.add_argument("--result-dir", default=None, metavar="DIR",
                       help="folder of the --save-result file (default: the current one)")
    group.add_argument("--result-filename", default=None, metavar="FILE",
                       help="name of the --save-result file (default: vlite-serve-<rate>qps[-concurrency<N>]-"
                            "<model>-<date-time>.json)")
    group.add_argument("--output-json", default=None, metavar="FILE",
                       help="save the results as JSON to FILE (as the other benchmarks; same content as "
                            "--save-result)")
    group.add_argument("--plot", default=None, metavar="FILE.png",
                       help="draw TTFT and ITL percentiles over time and output tokens/s in 1-s bins (needs "
                            "matplotlib)")
    group.add_argument("--progress", action="store_true", help="show a progress bar of finished requests")


def result_path(ns: argparse.Namespace, model: str) -> Optional[str]:
    """Where the JSON goes: --output-json, else with --save-result --result-dir/--result-filename."""
    if ns.output_json:
        return ns.output_json
    if not ns.save_result:
        return None
    name = ns.result_filename
    if not name:
        rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
        concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
        safe_model = re.sub(r"[^A-Za-z0-9._-]+", "_", model.split("/")[-1]) or "model"
        name = f"vlite-serve-{rate}qps{concurrency}-{safe_model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if ns.result_dir:
        os.makedirs(ns.result_dir, exist_ok=True)
        return os.path.join(ns.result_dir, name)
    return name


# --------------------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------------------

async def _run(ns: argparse.Namespace) -> tuple[dict[str, Any], list[RequestRecord]]:
    import httpx

    base_url = ns.base_url.rstrip("/")
    chat = ns.endpoint.endswith("/chat/completions")
    headers = headers_for(api_key_from(ns.api_key))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: no proxy from the environment between the benchmark and the server.
    async with httpx.AsyncClient(timeout=httpx.Timeout(ns.request_timeout), limits=limits,
                                 trust_env=False) as client:
        model, root, requests, texts, vocab_source = await _workload(ns, client, base_url, headers, chat)
        payloads = [build_payload(model, r, chat, text, ns.ignore_eos, ns.temperature)
                    for r, text in zip(requests, texts)]
        url = base_url + ns.endpoint
        counts = summarize(requests)
        print(f"vlite bench serve: {url}, model {model}, {counts['num_requests']} requests "
              f"({counts['input_tokens']} input, {counts['output_tokens']} output tokens); prompts from "
              f"{vocab_source}", file=sys.stderr)
        rate_text = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g} requests/s"
        print(f"request rate: {rate_text}" + (f", burstiness {ns.burstiness:g}" if ns.burstiness != 1 else "") +
              f"; max concurrency: {ns.max_concurrency or 'none'}", file=sys.stderr)

        if ns.warmup:
            await _warmup(ns, client, url, headers, model, requests[0], texts[0], chat)

        bar = None
        if ns.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), unit="req", file=sys.stderr)
        times = arrival_times(len(requests), ns.request_rate, ns.seed, ns.burstiness)
        spec_before = await scrape_spec_counters(client, base_url)
        try:
            records, duration = await run_requests(client, url, headers, payloads, requests, times, chat,
                                                   ns.max_concurrency,
                                                   on_done=(lambda r: bar.update(1)) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        spec_after = await scrape_spec_counters(client, base_url)

    summary = _summary(ns, records, duration, spec_before, spec_after)
    results = {
        "benchmark": "serve",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {"base_url": base_url, "endpoint": ns.endpoint, "model": model, "model_root": root,
                   "prompts_from": vocab_source, "request_rate": "inf" if math.isinf(ns.request_rate)
                   else ns.request_rate, "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency,
                   "args": {k: v for k, v in jsonable_args(ns).items() if k != "api_key"}},
        "summary": summary,
        "requests": [r.to_dict() for r in records],
    }
    return results, records


def _summary(ns: argparse.Namespace, records: list[RequestRecord], duration: float,
             spec_before: Optional[dict[str, float]], spec_after: Optional[dict[str, float]]) -> dict[str, Any]:
    """The run's summary, printed as the report (stdout) with the first failures (stderr)."""
    summary = summarize_records(records, duration, ns.metric_percentiles)
    if spec_before is not None and spec_after is not None and spec_after["drafts"] > spec_before["drafts"]:
        summary["spec_decoding"] = spec_decoding_summary(spec_before, spec_after)
    print(format_report(summary, ns.request_rate, ns.max_concurrency, ns.metric_percentiles), flush=True)
    errors = [r for r in records if not r.success]
    for r in errors[:5]:
        print(f"request {r.index} failed: {r.error}", file=sys.stderr)
    if len(errors) > 5:
        print(f"... and {len(errors) - 5} more failed requests", file=sys.stderr)
    return summary


async def _workload(ns: argparse.Namespace, client: Any, base_url: str, headers: dict[str, str], chat: bool
                    ) -> tuple[str, Optional[str], list[BenchRequest], list[Optional[str]], str]:
    """The model to name, its root, the requests, their prompts as text (chat only), where the prompts came from."""
    models = await fetch_models(client, base_url, headers, ns.ready_timeout)
    served = models[0]
    model = ns.model or str(served["id"])
    root = next((m.get("root") for m in models if m.get("id") == model), None)

    tokenizer, vocab_source = None, "--dataset-path"
    if ns.dataset_path:
        requests = load_json_dataset(ns.dataset_path, ns.num_prompts)
        if chat and tokenizer_model_for(model, root, ns.tokenizer)[0]:
            tokenizer, _, _ = load_vocabulary(model, root, ns.tokenizer)
    else:
        tokenizer, pool, vocab_source = load_vocabulary(model, root, ns.tokenizer)
        requests = random_requests(ns.num_prompts or DEFAULT_NUM_PROMPTS, ns.input_len, ns.output_len,
                                   ns.range_ratio, ns.seed, token_ids=pool, shared_prefix_len=ns.shared_prefix_len)
    texts: list[Optional[str]] = [None] * len(requests)
    if chat:
        texts = list(await prompt_texts(client, base_url, headers, model, requests, tokenizer))
    return model, root, requests, texts, vocab_source


async def _warmup(ns: argparse.Namespace, client: Any, url: str, headers: dict[str, str], model: str,
                  first: BenchRequest, first_text: Optional[str], chat: bool) -> None:
    """One short untimed request (the first one's prompt reversed, at most 4 tokens); raises if it fails."""
    warm = BenchRequest(list(reversed(first.prompt_token_ids)), min(first.output_len, 4))
    warm_text = first_text[::-1] if chat and first_text is not None else None
    record = await stream_request(client, url, headers,
                                  build_payload(model, warm, chat, warm_text, ns.ignore_eos, ns.temperature),
                                  RequestRecord(-1, warm.prompt_len, warm.output_len), time.perf_counter(), chat)
    if not record.success:
        raise ValueError(f"the warmup request failed: {record.error}")


def run_serve_bench(ns: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark from parsed flags; returns the results (also printed, and saved if asked)."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ValueError("vlite bench serve needs httpx: pip install httpx") from None
    if ns.plot:
        require_matplotlib()  # before the run, not after it
    if ns.dataset_path:
        load_json_dataset(ns.dataset_path, ns.num_prompts)  # a bad file fails before anything is sent
    results, records = asyncio.run(_run(ns))
    if ns.plot:
        plot_results(records, results["summary"]["duration"], ns.plot,
                     title=f"vlite bench serve: {results['config']['model']}, rate "
                           f"{results['config']['request_rate']}, concurrency {ns.max_concurrency or 'none'}")
    write_json(result_path(ns, results["config"]["model"]), results)
    return results


def main(ns: argparse.Namespace) -> int:
    results = run_serve_bench(ns)
    return 0 if results["summary"]["completed"] else 1

"""The numbers of `vlite bench serve`: the summary of the records (vllm bench serve's keys), its report,
the server's speculative-decoding counters over the run, and the plot over time."""

from __future__ import annotations

import math
import sys
from typing import Any, Optional, Sequence

from vlite.benchmarks.serve.client import RequestRecord
from vlite.benchmarks.utils import percentile, spec_decoding_report

DEFAULT_PERCENTILES = (90.0, 99.0)
METRICS = (("ttft", "Time to First Token", "TTFT"),
           ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"),
           ("e2el", "End-to-end Latency", "E2EL"))


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------

def _stats(values_s: Sequence[float], percentiles: Sequence[float], name: str) -> dict[str, float]:
    ms = [1e3 * v for v in values_s]
    mean = sum(ms) / len(ms) if ms else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if ms else math.nan
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": percentile(ms, 50), f"std_{name}_ms": std}
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out


def output_token_times(records: Sequence[RequestRecord]) -> list[tuple[float, float]]:
    """(time, tokens) of every content chunk of the successful requests: each request's output tokens
    spread evenly over its chunks (one token per chunk when the server sends one per chunk)."""
    out = []
    for r in records:
        if r.success and r.chunk_at:
            share = r.output_tokens / len(r.chunk_at)
            out.extend((t, share) for t in r.chunk_at)
    return out


def tokens_per_bin(records: Sequence[RequestRecord], duration: float, bin_s: float = 1.0) -> list[float]:
    """Output tokens/s in consecutive `bin_s` bins from the start: the tokens that arrived in each bin
    divided by `bin_s` (the last bin may be partial and is still divided by the whole `bin_s`)."""
    n = max(1, math.ceil(duration / bin_s - 1e-9))
    counts = [0.0] * n
    for t, tokens in output_token_times(records):
        counts[min(n - 1, max(0, int(t / bin_s)))] += tokens
    return [c / bin_s for c in counts]


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight (sent, not yet ended) at once."""
    edges = []
    for r in records:
        if r.e2e is not None:
            edges.append((r.sent_at, 1))
            edges.append((r.sent_at + r.e2e, -1))
    peak = current = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a start at the same time
        current += step
        peak = max(peak, current)
    return peak


def summarize_records(records: Sequence[RequestRecord], duration: float,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The benchmark's summary (vllm bench serve's keys): counts, throughputs, latency statistics in ms."""
    ok = [r for r in records if r.success]
    duration = max(duration, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    bins = tokens_per_bin(records, duration) if ok else []
    summary: dict[str, Any] = {
        "duration": duration,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_output_tokens_per_s": max(bins) if bins else 0.0,
        "max_concurrent_requests": peak_concurrency(ok),
    }
    summary.update(_stats([r.ttft for r in ok if r.ttft is not None], percentiles, "ttft"))
    summary.update(_stats([t for t in (r.tpot for r in ok) if t is not None], percentiles, "tpot"))
    summary.update(_stats([g for r in ok for g in r.itl], percentiles, "itl"))
    summary.update(_stats([r.e2e for r in ok if r.e2e is not None], percentiles, "e2el"))
    return summary


def format_report(summary: dict[str, Any], request_rate: float, max_concurrency: Optional[int],
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> str:
    """The report, laid out as `vllm bench serve` prints it."""
    width = 50
    lines = [f"{' Serving Benchmark Result ':=^{width}}"]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Request rate configured (RPS):", "inf" if math.isinf(request_rate) else float(request_rate))
    row("Maximum request concurrency:", max_concurrency if max_concurrency else "none")
    row("Benchmark duration (s):", float(summary["duration"]))
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", float(summary["request_throughput"]))
    row("Output token throughput (tok/s):", float(summary["output_throughput"]))
    row("Peak output token throughput (tok/s):", float(summary["max_output_tokens_per_s"]))
    row("Peak concurrent requests:", summary["max_concurrent_requests"])
    row("Total token throughput (tok/s):", float(summary["total_token_throughput"]))
    for key, title, short in METRICS:
        lines.append(f"{title:-^{width}}")
        row(f"Mean {short} (ms):", float(summary[f"mean_{key}_ms"]))
        row(f"Median {short} (ms):", float(summary[f"median_{key}_ms"]))
        for q in percentiles:
            row(f"P{q:g} {short} (ms):", float(summary[f"p{q:g}_{key}_ms"]))
    spec = summary.get("spec_decoding")
    if spec:
        lines.append(f"{' Speculative Decoding ':-^{width}}")
        row("Acceptance rate (%):", 100.0 * spec["acceptance_rate"])
        row("Acceptance length:", float(spec["mean_acceptance_length"]))
        row("Drafts:", int(spec["num_drafts"]))
        row("Draft tokens:", int(spec["num_draft_tokens"]))
        row("Accepted tokens:", int(spec["num_accepted_tokens"]))
    lines.append("=" * width)
    return "\n".join(lines)


_SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens": "accepted"}


async def scrape_spec_counters(client: Any, base_url: str) -> Optional[dict[str, float]]:
    """The server's speculative-decoding counters from /metrics (vLLM's names), or None when it has none."""
    try:
        r = await client.get(base_url + "/metrics")
    except Exception:  # no /metrics (another server): the report just leaves the section out
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in _SPEC_COUNTERS:
            out[_SPEC_COUNTERS[name]] = out.get(_SPEC_COUNTERS[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return out if len(out) == len(_SPEC_COUNTERS) else None


def spec_decoding_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Acceptance over the run from the server's counters (/metrics): rate (accepted / draft tokens) and
    length (1 + accepted / drafts, vLLM's)."""
    from vlite.core.sched.stats import SpecDecodingStats

    def stats(c: dict[str, float]) -> SpecDecodingStats:
        return SpecDecodingStats(c["drafts"], c["draft_tokens"], c["accepted"])

    report = spec_decoding_report(stats(before), stats(after))
    assert report is not None
    return report


# --------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------

def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None


def plot_results(records: Sequence[RequestRecord], duration: float, path: str,
                 percentiles: Sequence[float] = (50.0, 90.0, 99.0), title: str = "") -> None:
    """Three panels over the benchmark's time, in 1-s bins: TTFT percentiles (requests by send time, each
    request a dot), ITL percentiles (gaps by arrival time), output tokens/s with the requests in flight."""
    require_matplotlib()
    from matplotlib.figure import Figure

    ok = [r for r in records if r.success]
    n = max(1, math.ceil(duration - 1e-9))
    centers = [i + 0.5 for i in range(n)]

    def binned(points: list[tuple[float, float]]) -> list[list[float]]:
        bins: list[list[float]] = [[] for _ in range(n)]
        for t, v in points:
            bins[min(n - 1, max(0, int(t)))].append(v)
        return bins

    fig = Figure(figsize=(10, 10), layout="constrained")
    ax_ttft, ax_itl, ax_tok = fig.subplots(3, 1, sharex=True)
    ttft_points = [(r.sent_at, 1e3 * r.ttft) for r in ok if r.ttft is not None]
    itl_points = [(t, 1e3 * g) for r in ok for t, g in zip(r.chunk_at[1:], r.itl)]
    for ax, points, name in ((ax_ttft, ttft_points, "TTFT"), (ax_itl, itl_points, "ITL")):
        if name == "TTFT" and points:
            ax.scatter([p[0] for p in points], [p[1] for p in points], s=6, alpha=0.3, color="gray",
                       label="each request")
        bins = binned(points)
        for q in percentiles:
            ys = [percentile(b, q) if b else math.nan for b in bins]
            ax.plot(centers, ys, marker="o", markersize=3, label=f"p{q:g}")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} percentiles per 1-s bin" + (" (by send time)" if name == "TTFT" else
                                                           " (by token arrival)"))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    rates = tokens_per_bin(records, duration)
    ax_tok.bar(centers[:len(rates)], rates, width=0.9, color="tab:blue", alpha=0.7, label="output tok/s")
    ax_tok.set_ylabel("output tokens/s")
    ax_tok.set_xlabel("time since the benchmark start (s)")
    ax_tok.set_title("output token throughput per 1-s bin, and requests in flight")
    ax_tok.grid(alpha=0.3)
    steps = sorted([(r.sent_at, 1) for r in ok if r.e2e is not None] +
                   [(r.sent_at + r.e2e, -1) for r in ok if r.e2e is not None], key=lambda e: (e[0], e[1]))
    if steps:
        xs, ys, current = [0.0], [0], 0
        for t, step in steps:
            current += step
            xs.append(t)
            ys.append(current)
        ax_conc = ax_tok.twinx()
        ax_conc.step(xs, ys, where="post", color="tab:red", label="requests in flight")
        ax_conc.set_ylabel("requests in flight")
        ax_conc.legend(loc="upper right", fontsize="small")
    ax_tok.legend(loc="upper left", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    print(f"plot saved to {path}", file=sys.stderr)

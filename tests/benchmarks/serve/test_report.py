"""`vlite.benchmarks.serve.report`: the summary math, the report's layout, the speculative-decoding section."""

from __future__ import annotations

import math
import re

import pytest

from vlite.benchmarks.serve.client import RequestRecord
from vlite.benchmarks.serve.report import (format_report, peak_concurrency, spec_decoding_summary, summarize_records,
                                           tokens_per_bin)


def _record(i, ttft, gaps, tokens, sent_at=0.0, prompt_len=10, success=True):
    chunk_at = [sent_at + ttft]
    for g in gaps:
        chunk_at.append(chunk_at[-1] + g)
    e2e = chunk_at[-1] - sent_at
    return RequestRecord(i, prompt_len, tokens, sent_at=sent_at, success=success, ttft=ttft, e2e=e2e,
                         itl=list(gaps), chunk_at=chunk_at, output_tokens=tokens, output_tokens_from_usage=True)


def test_summarize_records_math():
    records = [
        _record(0, 0.1, [0.02, 0.02, 0.02], 4, sent_at=0.0),  # e2e 0.16, tpot 0.02
        _record(1, 0.3, [0.05], 2, sent_at=0.5),  # e2e 0.35, tpot 0.05
        _record(2, 0.2, [], 1, sent_at=1.0),  # one token: no TPOT, no ITL
        RequestRecord(3, 99, 5, sent_at=0.2, error="HTTP 500: x"),  # failed: counted nowhere else
    ]
    s = summarize_records(records, duration=2.0, percentiles=(90, 99))
    assert (s["num_prompts"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5) and s["total_token_throughput"] == pytest.approx(18.5)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0) and s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(2 / 3) * 100)
    assert s["mean_tpot_ms"] == pytest.approx(35.0) and s["median_tpot_ms"] == pytest.approx(35.0)
    assert s["mean_itl_ms"] == pytest.approx(27.5) and s["median_itl_ms"] == pytest.approx(20.0)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 350 + 200) / 3)
    assert s["max_concurrent_requests"] == 1  # 0..0.16, 0.5..0.85, 1.0..1.2: never two at once
    assert s["max_output_tokens_per_s"] == pytest.approx(6.0)  # 4 tokens at 0.1..0.16 and 2 at 0.8, 0.85: bin 0


def test_tokens_per_bin_and_peak_concurrency():
    a = _record(0, 0.1, [0.5, 0.5], 3, sent_at=0.0)  # chunks at 0.1, 0.6, 1.1
    b = _record(1, 0.2, [1.0], 4, sent_at=0.5)  # 2 chunks (2 tokens each) at 0.7, 1.7
    assert tokens_per_bin([a, b], duration=2.5) == [4.0, 3.0, 0.0]
    assert tokens_per_bin([a], duration=0.3) == [3.0]  # one bin at least, divided by 1 s
    assert peak_concurrency([a, b]) == 2
    c = _record(2, 0.1, [], 1, sent_at=5.0)
    assert peak_concurrency([a, c]) == 1
    back_to_back = [_record(0, 1.0, [], 1, sent_at=0.0), _record(1, 1.0, [], 1, sent_at=1.0)]
    assert peak_concurrency(back_to_back) == 1  # an end and a start at the same instant


def test_summary_when_everything_failed():
    s = summarize_records([RequestRecord(0, 5, 5, error="x")], duration=1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["output_throughput"] == 0.0
    assert math.isnan(s["mean_ttft_ms"]) and math.isnan(s["p99_itl_ms"])
    assert "Failed requests:" in format_report(s, math.inf, None)


def test_format_report_layout():
    records = [_record(0, 0.1, [0.02, 0.02], 3), _record(1, 0.2, [0.03], 2, sent_at=0.1)]
    s = summarize_records(records, 1.0, (90, 99))
    text = format_report(s, 4.0, 8, (90, 99))
    lines = text.splitlines()
    assert lines[0].startswith("=") and "Serving Benchmark Result" in lines[0] and lines[-1] == "=" * 50
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Total token throughput (tok/s):", "Request rate configured (RPS):", "Maximum request concurrency:",
                  "Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                  "End-to-end Latency"):
        assert label in text, label
    for short in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "Median", "P90", "P99"):
            assert f"{stat} {short} (ms):" in text
    assert re.search(r"Mean TTFT \(ms\):\s+150\.00$", text, re.M)
    assert all(len(line) == 50 for line in lines)


def test_spec_decoding_section_from_metric_deltas():
    before = {"drafts": 10.0, "draft_tokens": 40.0, "accepted": 20.0}
    after = {"drafts": 30.0, "draft_tokens": 120.0, "accepted": 80.0}
    spec = spec_decoding_summary(before, after)
    assert spec["acceptance_rate"] == pytest.approx(60 / 80) and spec["mean_acceptance_length"] == pytest.approx(4.0)
    summary = {"completed": 1, "failed": 0, "duration": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
               "request_throughput": 1.0, "output_throughput": 1.0, "max_output_tokens_per_s": 1.0,
               "max_concurrent_requests": 1, "total_token_throughput": 2.0, "spec_decoding": spec}
    for key in ("ttft", "tpot", "itl", "e2el"):
        summary.update({f"mean_{key}_ms": 1.0, f"median_{key}_ms": 1.0, f"p99_{key}_ms": 1.0})
    text = format_report(summary, float("inf"), None, (99,))
    assert "Speculative Decoding" in text and "Acceptance length:" in text and "75.00" in text

"""`vlite bench`: flag parsing, datasets, statistics, the profiler, the scheduler benchmark (no model), and
one end-to-end throughput run on the real model (slow)."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest

from vlite import profiler
from vlite.benchmarks import BENCHMARKS, latency, scheduler, throughput
from vlite.benchmarks.datasets import (BenchRequest, allowed_token_ids, length_range, load_json_dataset,
                                       random_requests, summarize)
from vlite.benchmarks.utils import describe, percentile
from vlite.entrypoints import cli
from vlite.entrypoints.cli.args import engine_args_from_cli


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


# --------------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------------

def test_every_benchmark_is_a_subcommand():
    for name in BENCHMARKS:
        ns = parse("bench", name)
        assert ns.command == "bench" and ns.bench_name == name and callable(ns.handler)


def test_every_bench_option_has_help():
    parser = cli.build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(a for a in top.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    assert set(bench.choices) == set(BENCHMARKS)
    for name, sub in bench.choices.items():
        for action in sub._actions:
            assert action.help, f"bench {name}: {action.option_strings or action.dest} has no help"


def test_bench_needs_a_name(capsys):
    with pytest.raises(SystemExit):
        parse("bench")


def test_throughput_flags():
    ns = parse("bench", "throughput", "--num-prompts", "10", "--input-len", "64", "--output-len", "8",
               "--range-ratio", "0.25", "--seed", "3", "--dtype", "float32", "--compare-hf", "--hf-batch-size", "4",
               "--hf-dtype", "bfloat16", "--output-json", "out.json", "--profile", "--progress",
               "--max-num-seqs", "16", "--no-enable-prefix-caching")
    assert (ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, ns.seed) == (10, 64, 8, 0.25, 3)
    assert ns.compare_hf and ns.hf_batch_size == 4 and ns.hf_dtype == "bfloat16"
    assert ns.output_json == "out.json" and ns.profile and ns.progress
    args = engine_args_from_cli(ns)
    assert args.dtype == "float32" and args.max_num_seqs == 16 and args.enable_prefix_caching is False
    assert args.seed == 3


def test_throughput_defaults():
    ns = parse("bench", "throughput")
    assert ns.dataset == "random" and ns.dataset_path is None and ns.num_prompts is None
    assert ns.range_ratio == 0.0 and not ns.compare_hf and ns.hf_batch_size == 16 and ns.hf_dtype == "float32"
    assert ns.warmup and not ns.profile


@pytest.mark.parametrize("argv", [
    ["--range-ratio", "1.0"], ["--range-ratio", "-0.1"], ["--num-prompts", "0"], ["--input-len", "x"],
    ["--dataset", "sharegpt"], ["--hf-dtype", "int8"],
])
def test_throughput_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        parse("bench", "throughput", *argv)


def test_latency_prefix_cache_scheduler_flags():
    ns = parse("bench", "latency", "--batch-size", "1", "--input-len", "4", "--output-len", "3", "--num-iters", "2",
               "--num-iters-warmup", "0", "--dtype", "float32")
    assert (ns.batch_size, ns.input_len, ns.output_len, ns.num_iters, ns.num_iters_warmup) == (1, 4, 3, 2, 0)
    ns = parse("bench", "prefix-cache")
    assert ns.prompt_len == 1000 and ns.enable_prefix_caching
    ns = parse("bench", "prefix-cache", "--prompt-len", "64", "--no-enable-prefix-caching")
    assert ns.prompt_len == 64 and not ns.enable_prefix_caching
    ns = parse("bench", "prefix-cache", "--restart", "--kv-offload-dir", "/tmp/kv")
    assert ns.restart and ns.kv_offload_dir == "/tmp/kv"
    ns = parse("bench", "scheduler")
    assert ns.num_requests == 256 and not hasattr(ns, "model")  # no model, no engine flags


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length, ratio, expected", [
    (100, 0.0, (100, 100)), (100, 0.5, (50, 150)), (10, 0.25, (8, 12)), (1, 0.9, (1, 1)), (3, 0.5, (2, 4)),
])
def test_length_range(length, ratio, expected):
    assert length_range(length, ratio) == expected


def test_length_range_rejects():
    with pytest.raises(ValueError):
        length_range(10, 1.0)
    with pytest.raises(ValueError):
        length_range(0, 0.0)


def test_random_requests_lengths_within_range():
    reqs = random_requests(200, input_len=40, output_len=10, range_ratio=0.5, seed=1, vocab_size=500)
    assert len(reqs) == 200
    assert all(20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15 for r in reqs)
    # Uniform over the range: both ends are reached with 200 draws.
    assert min(r.prompt_len for r in reqs) < 25 and max(r.prompt_len for r in reqs) > 55


def test_random_requests_exact_lengths_without_range():
    reqs = random_requests(5, input_len=16, output_len=4, vocab_size=100)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(16, 4)] * 5
    assert summarize(reqs) == {"num_requests": 5, "input_tokens": 80, "output_tokens": 20}


def test_random_requests_reproducible_and_seeded():
    a = random_requests(8, 32, 8, 0.3, seed=7, vocab_size=1000)
    b = random_requests(8, 32, 8, 0.3, seed=7, vocab_size=1000)
    c = random_requests(8, 32, 8, 0.3, seed=8, vocab_size=1000)
    assert a == b
    assert a != c


def test_random_requests_avoid_special_tokens():
    special = set(range(0, 17)) | {99}
    reqs = random_requests(20, 50, 1, vocab_size=100, special_ids=special, seed=2)
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert ids and not ids & special and max(ids) < 100
    assert allowed_token_ids(5, [0, 4]) == [1, 2, 3]
    with pytest.raises(ValueError):
        allowed_token_ids(2, [0, 1])


def test_load_json_dataset(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt_token_ids": [1, 2, 3], "output_len": 4},
                                {"prompt_token_ids": [5], "output_len": 1, "extra": "ignored"}]))
    assert load_json_dataset(str(path)) == [BenchRequest([1, 2, 3], 4), BenchRequest([5], 1)]
    assert load_json_dataset(str(path), num_prompts=1) == [BenchRequest([1, 2, 3], 4)]


@pytest.mark.parametrize("content", [
    "not json", "{}", "[]", '[{"prompt_token_ids": [], "output_len": 1}]',
    '[{"prompt_token_ids": [1, "a"], "output_len": 1}]', '[{"prompt_token_ids": [1], "output_len": 0}]',
    '[{"prompt_token_ids": [1]}]', '[[1, 2]]',
])
def test_load_json_dataset_rejects(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        load_json_dataset(str(path))
    with pytest.raises(ValueError):
        load_json_dataset(str(tmp_path / "missing.json"))


def test_throughput_reads_dataset_path(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt_token_ids": [1, 2], "output_len": 3}] * 5))
    ns = parse("bench", "throughput", "--dataset-path", str(path), "--num-prompts", "2")
    assert throughput.get_requests(ns) == [BenchRequest([1, 2], 3)] * 2


# --------------------------------------------------------------------------------------------------
# Statistics and reports
# --------------------------------------------------------------------------------------------------

def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert math.isnan(percentile([], 50))
    d = describe([1.0, 2.0, 3.0])
    assert d["mean"] == 2.0 and d["p50"] == 2.0 and d["count"] == 3 and set(d) == {"mean", "p50", "p90", "p99",
                                                                                   "count"}


def test_latency_stats_from_stamps():
    batches = [{"stamps": [[0.1, 0.2, 0.4], [0.15, 0.25, 0.35]], "batch_s": 0.5}]
    stats = latency.latency_stats(batches)
    assert stats["ttft_ms"]["mean"] == pytest.approx(125.0)
    assert stats["itl_ms"]["count"] == 4 and stats["itl_ms"]["p50"] == pytest.approx(100.0)
    assert stats["e2e_ms"]["mean"] == pytest.approx(375.0)
    assert stats["batch_ms"]["mean"] == pytest.approx(500.0)
    assert "inter-token latency" in latency.format_table(stats)


class _FakeHFModel:
    """generate() appends max_new_tokens zeros; records the batches it saw."""

    def __init__(self) -> None:
        self.generation_config = SimpleNamespace(pad_token_id=None, eos_token_id=[2])
        self.config = SimpleNamespace(eos_token_id=2)
        self.calls: list[tuple] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, min_new_tokens, pad_token_id, **kwargs):
        import torch

        self.calls.append((input_ids.clone(), attention_mask.clone(), max_new_tokens, min_new_tokens, pad_token_id))
        return torch.cat([input_ids, torch.zeros(input_ids.shape[0], max_new_tokens, dtype=input_ids.dtype)], 1)


def test_run_hf_counts_own_output_lengths_and_left_pads():
    model = _FakeHFModel()
    reqs = [BenchRequest([5, 6, 7], 2), BenchRequest([8], 5), BenchRequest([9, 9], 3)]
    result = throughput.run_hf(model, reqs, batch_size=2, warmup=False)
    assert result["num_requests"] == 3 and result["input_tokens"] == 6 and result["output_tokens"] == 10
    # Batch 1 generates 5 tokens per row (2 + 5 counted, 3 of padding); batch 2 exactly 3.
    assert result["padding_output_tokens"] == 3
    ids, mask, max_new, min_new, pad = model.calls[0]
    assert ids.tolist() == [[5, 6, 7], [2, 2, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert max_new == min_new == 5 and pad == 2


# --------------------------------------------------------------------------------------------------
# Scheduler benchmark (no model)
# --------------------------------------------------------------------------------------------------

def test_scheduler_bench_tiny():
    result = scheduler.run_scheduler_bench(num_requests=8, prompt_len=20, num_steps=30, num_warmup_steps=2,
                                           block_size=4, max_num_batched_tokens=32)
    assert result["step_us"]["count"] == 30 and result["step_us"]["mean"] > 0
    assert result["step_us"]["p50"] <= result["step_us"]["p99"]
    assert result["prefill_steps"] >= 1 and result["steps_per_s"] > 0
    assert result["schedule_us"]["mean"] + result["update_from_output_us"]["mean"] == pytest.approx(
        result["step_us"]["mean"])


def test_scheduler_bench_cli(tmp_path, capsys):
    out = tmp_path / "sched.json"
    rc = cli.main(["bench", "scheduler", "--num-requests", "4", "--prompt-len", "8", "--num-steps", "10",
                   "--num-warmup-steps", "1", "--no-enable-prefix-caching", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "schedule + update_from_output" in text and "Mean µs per step" in text
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "scheduler" and saved["num_requests"] == 4 and not saved["enable_prefix_caching"]


# --------------------------------------------------------------------------------------------------
# Profiler
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def clean_profiler(monkeypatch):
    monkeypatch.delenv(profiler.ENV_VAR, raising=False)  # restored after the test (--profile sets it)
    was = profiler.is_enabled()
    profiler.reset()
    yield profiler
    profiler.enable(was)
    profiler.reset()


def test_profiler_disabled_records_nothing(clean_profiler):
    profiler.enable(False)
    with profiler.section("schedule"):
        with profiler.section("attention"):
            pass
    assert profiler.summary() == {} and profiler.num_steps() == 0
    assert profiler.section("x") is profiler.section("y")  # one shared no-op object


def test_profiler_sections_sum(clean_profiler):
    import time

    profiler.enable()
    start = time.perf_counter()
    for _ in range(3):
        with profiler.section("schedule"):
            time.sleep(0.001)
        with profiler.section("forward"):
            time.sleep(0.001)
            for _ in range(2):
                with profiler.section("attention"):
                    time.sleep(0.001)
    wall = time.perf_counter() - start
    data = profiler.summary()
    assert list(data) == ["schedule", "attention", "forward"]  # the table's phase order
    assert data["attention"]["calls"] == 6 and data["forward"]["calls"] == 3 and profiler.num_steps() == 3
    # Exclusive times: forward excludes its attention, and the rows add up to the top-level sections.
    assert data["attention"]["seconds"] >= 0.006 and data["forward"]["seconds"] >= 0.003
    total = sum(d["seconds"] for d in data.values())
    assert total <= wall and total >= 0.012
    table = profiler.format_summary(wall_s=wall)
    assert "model: attention (paged_attention)" in table and "engine steps: 3" in table
    profiler.print_summary()
    assert profiler.summary() == {}  # printed, then reset


def test_profiler_exception_inside_section(clean_profiler):
    profiler.enable()
    with pytest.raises(RuntimeError):
        with profiler.section("outer"):
            with profiler.section("inner"):
                raise RuntimeError
    assert profiler.summary()["inner"]["calls"] == 1 and profiler.summary()["outer"]["calls"] == 1
    with profiler.section("after"):  # the nesting stack is back to empty
        pass
    assert profiler._stack == []


# --------------------------------------------------------------------------------------------------
# End to end (the real model)
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_throughput_end_to_end(model_dir, capsys, tmp_path, clean_profiler):
    out = tmp_path / "tp.json"
    rc = cli.main(["bench", "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
                   "--dtype", "float32", "--kv-cache-memory", "64M", "--output-json", str(out), "--profile"])
    assert rc == 0
    text = capsys.readouterr().out
    for field in ("Requests:", "Input tokens:", "Output tokens:", "Elapsed (s):", "Requests/s:", "Input tok/s:",
                  "Output tok/s:", "Total tok/s:", "vlite step profile", "model: attention"):
        assert field in text, field
    saved = json.loads(out.read_text())
    v = saved["vlite"]
    assert (v["num_requests"], v["input_tokens"], v["output_tokens"]) == (4, 64, 16)
    assert v["total_tokens_per_s"] == pytest.approx(80 / v["elapsed_s"])
    assert saved["profile"]["steps"] >= 4 and "attention" in saved["profile"]["phases"]


def test_copy_requests_ask_to_copy_their_own_text(hf_tokenizer):
    from vlite.benchmarks.datasets import copy_requests

    reqs = copy_requests(hf_tokenizer, 6, 64, seed=3)
    assert reqs == copy_requests(hf_tokenizer, 6, 64, seed=3)  # reproducible
    assert all(not r.ignore_eos and r.output_len == 64 for r in reqs)
    texts = [hf_tokenizer.decode(r.prompt_token_ids) for r in reqs]
    assert "Repeat the following text exactly" in texts[0] and "Correct the spelling" in texts[1]
    assert "Rename the function" in texts[2] and "def " in texts[2] and all("<|im_start|>assistant" in t for t in texts)


def test_decode_bandwidth_report_counts_the_linears_once():
    """Bytes per decode token: each packed linear's tiles and each dense 2-D weight once, not the embedding;
    the read bandwidth is measured by the kernels (positive GB/s)."""
    import torch
    from torch import nn

    from vlite.benchmarks import bandwidth
    from vlite.layers.quantization import QuantizedLinear, quantize_int4

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Parameter(torch.zeros(100, 64), requires_grad=False)
            self.proj = QuantizedLinear(quantize_int4(torch.randn(32, 64)), torch.float32)
            self.dense = nn.Parameter(torch.zeros(16, 64), requires_grad=False)
            self.norm = nn.Parameter(torch.ones(64), requires_grad=False)

    model = Tiny()
    t = model.proj.tiled
    packed = sum(x.numel() * x.element_size() for x in (t.qt, t.scales, t.mins) if x is not None) if t is not None \
        else model.proj.dense.numel() * model.proj.dense.element_size()
    assert bandwidth.decode_weight_bytes(model) == packed + 16 * 64 * 4
    gbs = bandwidth.measure_read_bandwidth(gib=0.01, iters=2)
    assert gbs is None or gbs > 0.1
    report = {"decode_weight_bytes_per_token": 8e8, "decode_gb_per_s": 30.0, "read_bandwidth_gb_per_s": 40.0,
              "decode_share_of_read_bandwidth": 0.75}
    assert "800.0 MB, 30.0 GB/s = 75% of the measured read bandwidth (40.0 GB/s" in bandwidth.format_bandwidth(report)


@pytest.mark.slow
def test_prefix_cache_restart_end_to_end(capsys, tmp_path):
    """Two engine processes on one KV store: the second loads the prompt's blocks (a temporary store here)."""
    from vlite.benchmarks.prefix_cache_restart import run_restart

    out = tmp_path / "restart.json"
    ns = parse("bench", "prefix-cache", "--restart", "--prompt-len", "100", "--num-iters-warmup", "1",
               "--output-len", "2", "--dtype", "float32", "--output-json", str(out))
    results = run_restart(ns)
    assert results["restart_cached_tokens"] == results["restart_external_hits"] == 96
    assert ns.kv_offload_dir is None and json.loads(out.read_text())["benchmark"] == "prefix-cache-restart"
    assert "TTFT after restart" in capsys.readouterr().out

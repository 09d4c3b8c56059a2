"""`vlite.entrypoints.cli.args`: the engine and sampling flags and their validators, parsed without a model."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

import pytest

from tests.entrypoints.cli.utils import parse
from vlite.engine.arg_utils import EngineArgs
from vlite.entrypoints.cli.args import (engine_args_from_cli, non_negative_float, non_negative_int, parse_size,
                                        positive_float, positive_int, sampling_params)
from vlite.sampling_params import RequestOutputKind


@pytest.mark.parametrize("text, expected", [
    ("1024", 1024),
    ("512M", 512 * 2**20),
    ("512m", 512 * 2**20),
    ("1G", 2**30),
    ("1GiB", 2**30),
    ("1gib", 2**30),
    ("2Gi", 2 * 2**30),
    ("64K", 64 * 1024),
    ("1.5G", int(1.5 * 2**30)),
    ("500MB", 500 * 10**6),
    ("1GB", 10**9),
    ("1T", 2**40),
    (" 8M ", 8 * 2**20),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "abc", "1X", "-1G", "0", "1.2.3G", "1iB", "0.0000001K"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_kv_cache_memory_flag_takes_suffixes():
    assert parse("generate", "x", "--kv-cache-memory", "256M").kv_cache_memory == 256 * 2**20
    assert engine_args_from_cli(parse("chat", "--kv-cache-memory", "1GiB")).kv_cache_memory_bytes == 2**30


def test_bad_flag_values_are_usage_errors(capsys):
    for argv in (["generate", "x", "--kv-cache-memory", "lots"], ["generate", "x", "--dtype", "float64"],
                 ["chat", "--scheduling-policy", "lifo"], ["chat", "--max-num-seqs", "0"], ["chat", "--max-loras", "0"], ["generate"]):
        with pytest.raises(SystemExit) as exc:
            parse(*argv)
        assert exc.value.code == 2
    assert "invalid" in capsys.readouterr().err


def test_prefix_caching_is_a_boolean_flag():
    assert parse("chat").enable_prefix_caching is True
    assert parse("chat", "--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("chat", "--enable-prefix-caching").enable_prefix_caching is True


def test_defaults_equal_engine_args_defaults():
    assert engine_args_from_cli(parse("generate", "x")) == EngineArgs()
    assert engine_args_from_cli(parse("chat")) == EngineArgs()


def test_engine_args_from_cli_maps_every_flag():
    ns = parse("generate", "hello", "--model", "/models/m.gguf", "--dtype", "bfloat16", "--max-model-len", "1000",
               "--max-num-seqs", "7", "--max-num-batched-tokens", "333", "--block-size", "32",
               "--kv-cache-memory", "64M", "--seed", "42", "--no-enable-prefix-caching",
               "--scheduling-policy", "priority", "--long-prefill-token-threshold", "128",
               "--max-num-partial-prefills", "3", "--chat-template", "{{ messages }}", "--quantization", "int4",
               "--device", "cuda", "--enforce-eager", "--gpu-memory-utilization", "0.5", "--threads", "5",
               "-tp", "2", "--data-parallel-size", "3", "--distributed-executor-backend", "ray",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--runner", "pooling",
               "--convert", "embed", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
               "--max-cpu-loras", "5", "--kv-offload-dir", "/tmp/kv", "--kv-offload-size", "2.5",
               "--reasoning-parser", "generic", "--reasoning-config", '{"reasoning_end_str": "</r>"}',
               "--reasoning-budget", "64")
    expected = EngineArgs(model="/models/m.gguf", dtype="bfloat16", max_model_len=1000, max_num_seqs=7,
                          max_num_batched_tokens=333, block_size=32, kv_cache_memory_bytes=64 * 2**20, seed=42,
                          enable_prefix_caching=False, scheduling_policy="priority", long_prefill_token_threshold=128,
                          max_num_partial_prefills=3, chat_template="{{ messages }}", quantization="int4",
                          device="cuda", enforce_eager=True, gpu_memory_utilization=0.5, num_threads=5,
                          tensor_parallel_size=2, data_parallel_size=3, distributed_executor_backend="ray",
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 2}', runner="pooling",
                          convert="embed", enable_lora=True, max_loras=3, max_lora_rank=64, max_cpu_loras=5,
                          kv_offload_dir="/tmp/kv", kv_offload_size=2.5, reasoning_parser="generic",
                          reasoning_config='{"reasoning_end_str": "</r>"}', reasoning_budget=64)
    got = engine_args_from_cli(ns)
    assert got == expected
    # Every EngineArgs field differs from its default here, so each one really came from a flag.
    default = EngineArgs()
    assert [f.name for f in fields(EngineArgs) if getattr(got, f.name) == getattr(default, f.name)] == []


def test_chat_template_file_or_literal(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = engine_args_from_cli(parse("chat", "--chat-template", str(path)))
    assert args.chat_template == path.read_text()
    literal = "{{ messages[0].content }}"
    assert engine_args_from_cli(parse("chat", "--chat-template", literal)).chat_template == literal
    with pytest.raises(ValueError, match="does not exist"):
        engine_args_from_cli(parse("chat", "--chat-template", str(tmp_path / "missing.jinja")))


def test_sampling_flags():
    ns = parse("generate", "x", "--max-tokens", "5", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "40",
               "--ignore-eos")
    params = sampling_params(ns)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.ignore_eos) == \
        (5, 0.5, 0.9, 40, True)
    assert params.output_kind == RequestOutputKind.DELTA


def test_number_validators_accept():
    assert (positive_int("3"), non_negative_int("0")) == (3, 0)
    assert (positive_float("0.5"), non_negative_float("0")) == (0.5, 0.0)


@pytest.mark.parametrize("validator, text, message", [
    (positive_int, "0", "must be at least 1, got 0"),
    (positive_int, "1.5", "invalid integer '1.5'"),
    (non_negative_int, "-1", "must be non-negative, got -1"),
    (positive_float, "0", "must be a positive number, got 0"),
    (positive_float, "inf", "must be a positive number, got inf"),
    (non_negative_float, "-0.5", "must be a non-negative number, got -0.5"),
    (non_negative_float, "x", "invalid number 'x'"),
])
def test_number_validators_reject(validator, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(message)}$"):
        validator(text)

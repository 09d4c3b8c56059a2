"""`vlite bench serve` as a command: its flags, whole runs against the fake OpenAI server (uvicorn in a thread),
and one slow smoke test against a real `vlite serve`."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time

import pytest

from tests.benchmarks.serve.fake_server import FAKE_KEY, FIRST_DELAY, TOKEN_DELAY, fake_app
from vlite.benchmarks.serve.workload import FALLBACK_TOKEN_IDS, arrival_times
from vlite.entrypoints import cli


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", "serve", *argv])


# --------------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------------

def test_serve_defaults():
    ns = parse()
    assert ns.base_url == "http://127.0.0.1:8000" and ns.endpoint == "/v1/completions" and ns.model is None
    assert math.isinf(ns.request_rate) and ns.max_concurrency is None and ns.burstiness == 1.0
    assert ns.ignore_eos and ns.warmup and ns.temperature is None and ns.num_prompts is None
    assert ns.metric_percentiles == (90.0, 99.0) and not ns.save_result and ns.plot is None
    assert not hasattr(ns, "dtype")  # no engine flags: nothing is loaded


def test_serve_flags():
    ns = parse("--base-url", "http://h:1", "--api-key", "k", "--model", "m", "--endpoint", "/v1/chat/completions",
               "--num-prompts", "7", "--input-len", "16", "--output-len", "4", "--range-ratio", "0.5", "--seed", "3",
               "--request-rate", "2.5", "--burstiness", "0.5", "--max-concurrency", "2", "--temperature", "0",
               "--no-ignore-eos", "--no-warmup", "--metric-percentiles", "50,95", "--save-result",
               "--result-dir", "d", "--result-filename", "f.json", "--plot", "p.png", "--progress")
    assert (ns.base_url, ns.api_key, ns.model, ns.endpoint) == ("http://h:1", "k", "m", "/v1/chat/completions")
    assert (ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, ns.seed) == (7, 16, 4, 0.5, 3)
    assert (ns.request_rate, ns.burstiness, ns.max_concurrency, ns.temperature) == (2.5, 0.5, 2, 0.0)
    assert not ns.ignore_eos and not ns.warmup and ns.metric_percentiles == (50.0, 95.0)
    assert ns.save_result and ns.result_dir == "d" and ns.result_filename == "f.json" and ns.plot == "p.png"
    assert math.isinf(parse("--request-rate", "inf").request_rate)


@pytest.mark.parametrize("argv", [
    ["--request-rate", "0"], ["--request-rate", "-1"], ["--request-rate", "nan"], ["--request-rate", "x"],
    ["--max-concurrency", "0"], ["--burstiness", "0"], ["--endpoint", "/v1/embeddings"],
    ["--metric-percentiles", "100"], ["--metric-percentiles", "a"], ["--range-ratio", "1"],
])
def test_serve_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)


# --------------------------------------------------------------------------------------------------
# Runs against the fake server
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    from tests.entrypoints.openai.conftest import free_port

    received: list = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_app(received), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", received
    server.should_exit = True
    thread.join(10)


def run_bench(url: str, tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "serve.json"
    rc = cli.main(["bench", "serve", "--base-url", url, "--api-key", FAKE_KEY, "--output-json", str(out), *argv])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def test_fake_server_run(fake_server, tmp_path, capsys):
    url, received = fake_server
    received.clear()
    rc, saved = run_bench(url, tmp_path, "--num-prompts", "6", "--input-len", "8", "--output-len", "5")
    assert rc == 0
    out = capsys.readouterr()
    assert "Serving Benchmark Result" in out.out and "token ids 1000..29999" in out.err
    s = saved["summary"]
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (6, 0, 48, 30)
    assert saved["config"]["model"] == "fake-model" and saved["config"]["model_root"] == "fake-root"
    assert "api_key" not in saved["config"]["args"]  # the key is not written to disk
    # One warmup (4 tokens, reversed prompt) and then the 6 requests, as the server received them.
    assert len(received) == 7 and received[0]["max_tokens"] == 4
    # (the 6 are sent concurrently, so they may arrive in any order)
    assert list(reversed(received[0]["prompt"])) in [body["prompt"] for body in received[1:]]
    for body in received[1:]:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 5 and "temperature" not in body
        assert len(body["prompt"]) == 8 and all(t in FALLBACK_TOKEN_IDS for t in body["prompt"])
    for r in saved["requests"]:
        assert r["success"] and r["output_tokens"] == 5 and r["output_tokens_from_usage"]
        assert r["ttft"] >= 0.9 * FIRST_DELAY and len(r["itl"]) == 4 and len(r["chunk_at"]) == 5
        assert all(g >= 0.5 * TOKEN_DELAY for g in r["itl"])
        assert r["e2e"] >= r["ttft"] + sum(r["itl"]) - 1e-6
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / 4)
        assert r["prompt_tokens"] == 8 and r["output_chars"] == len("t0 t1 t2 t3 t4 ")
    assert s["mean_ttft_ms"] >= 0.9 * 1e3 * FIRST_DELAY and s["mean_tpot_ms"] >= 0.5 * 1e3 * TOKEN_DELAY
    assert s["request_throughput"] == pytest.approx(6 / s["duration"])
    assert s["max_concurrent_requests"] >= 1


def test_fake_server_max_concurrency_one(fake_server, tmp_path, capsys):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--num-prompts", "3", "--input-len", "4", "--output-len", "2",
                          "--max-concurrency", "1", "--no-warmup")
    assert rc == 0 and saved["summary"]["max_concurrent_requests"] == 1
    reqs = saved["requests"]
    for a, b in zip(reqs, reqs[1:]):  # strictly one after the other
        assert b["sent_at"] >= a["sent_at"] + a["e2e"] - 1e-6
    assert saved["summary"]["duration"] >= 3 * FIRST_DELAY


def test_fake_server_request_rate_schedule(fake_server, tmp_path, capsys):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--num-prompts", "4", "--input-len", "4", "--output-len", "2",
                          "--request-rate", "20", "--seed", "5", "--no-warmup")
    assert rc == 0
    expected = arrival_times(4, 20.0, seed=5)
    reqs = saved["requests"]
    assert [r["scheduled_at"] for r in reqs] == pytest.approx(expected)
    assert all(r["sent_at"] >= r["scheduled_at"] - 1e-6 for r in reqs)
    assert saved["summary"]["duration"] >= expected[-1]
    assert saved["config"]["request_rate"] == 20.0
    assert "Request rate configured (RPS):" in capsys.readouterr().out


def test_fake_server_chat(fake_server, tmp_path, capsys):
    url, received = fake_server
    received.clear()
    rc, saved = run_bench(url, tmp_path, "--endpoint", "/v1/chat/completions", "--num-prompts", "2",
                          "--input-len", "3", "--output-len", "3", "--temperature", "0", "--no-warmup")
    assert rc == 0
    for body in received:
        assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"].startswith("w")
        assert body["max_completion_tokens"] == 3 and body["temperature"] == 0
    for r in saved["requests"]:  # the role chunk is not the first token
        assert r["success"] and r["ttft"] >= 0.9 * FIRST_DELAY and len(r["itl"]) == 2 and r["output_tokens"] == 3


def test_fake_server_without_usage_counts_chunks(fake_server, tmp_path, capsys):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--model", "no-usage", "--num-prompts", "2", "--input-len", "2",
                          "--output-len", "3", "--no-warmup")
    assert rc == 0
    assert all(r["output_tokens"] == 3 and not r["output_tokens_from_usage"] for r in saved["requests"])


@pytest.mark.parametrize("model, message", [
    ("fail-http", "HTTP 400: bad request here"), ("fail-stream", "error event: engine exploded"),
    ("no-done", "the stream ended before data: [DONE]"),
])
def test_fake_server_failures(fake_server, tmp_path, capsys, model, message):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--model", model, "--num-prompts", "2", "--input-len", "2",
                          "--output-len", "3", "--no-warmup")
    assert rc == 1  # nothing succeeded
    assert saved["summary"]["completed"] == 0 and saved["summary"]["failed"] == 2
    assert all(r["error"] == message for r in saved["requests"])
    err = capsys.readouterr().err
    assert f"request 0 failed: {message}" in err


def test_fake_server_failing_warmup_stops_the_run(fake_server, tmp_path, capsys):
    url, _ = fake_server
    rc, saved = run_bench(url, tmp_path, "--model", "fail-http", "--num-prompts", "2", "--input-len", "2")
    assert rc == 2 and saved == {}
    assert "the warmup request failed: HTTP 400: bad request here" in capsys.readouterr().err


def test_fake_server_api_key(fake_server, tmp_path, capsys, monkeypatch):
    url, _ = fake_server
    monkeypatch.delenv("VLITE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "answered 401: invalid API key" in err and "--api-key" in err
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)  # the key from the environment
    out = tmp_path / "env.json"
    assert cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "1", "--input-len", "2", "--output-len",
                     "2", "--no-warmup", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["completed"] == 1


def test_unreachable_server(capsys):
    from tests.entrypoints.openai.conftest import free_port

    rc = cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"])
    assert rc == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_fake_server_save_result_and_plot(fake_server, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    url, _ = fake_server
    png = tmp_path / "plot.png"
    rc = cli.main(["bench", "serve", "--base-url", url, "--api-key", FAKE_KEY, "--num-prompts", "4",
                   "--input-len", "4", "--output-len", "3", "--request-rate", "50", "--no-warmup", "--save-result",
                   "--result-dir", str(tmp_path / "results"), "--plot", str(png)])
    assert rc == 0
    files = list((tmp_path / "results").iterdir())
    assert len(files) == 1 and re.fullmatch(r"vlite-serve-50qps-fake-model-\d{8}-\d{6}\.json", files[0].name)
    saved = json.loads(files[0].read_text())
    assert len(saved["requests"]) == 4 and saved["summary"]["completed"] == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    assert "--plot needs matplotlib, which is not installed: pip install matplotlib" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# A real `vlite serve` (slow)
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    from tests.entrypoints.openai.conftest import start_server, stop_server

    srv = start_server(tmp_path_factory, "--kv-cache-memory", "64M")
    yield srv
    assert stop_server(srv) == 0, open(srv.log_path).read()[-3000:]


@pytest.mark.slow
def test_serve_bench_against_vlite_serve(real_server, tmp_path, capsys):
    out = tmp_path / "real.json"
    rc = cli.main(["bench", "serve", "--base-url", real_server.url, "--api-key", real_server.api_key,
                   "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr()
    assert "Serving Benchmark Result" in text.out and "SmolLM2-135M-Instruct" in text.err  # the model's tokenizer
    saved = json.loads(out.read_text())
    s = saved["summary"]
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (4, 0, 64, 16)
    for r in saved["requests"]:
        assert r["output_tokens_from_usage"] and r["prompt_tokens"] == 16 and r["output_tokens"] == 4
        assert 0 < r["ttft"] <= r["e2e"] and r["tpot"] > 0 and 1 <= len(r["itl"]) <= 3
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms"):
        assert s[key] > 0

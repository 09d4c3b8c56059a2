"""`vlite bench startup`: fresh processes on the default model, the first with an empty model cache."""

from __future__ import annotations

import pytest

from vlite.benchmarks import startup


@pytest.mark.slow
def test_startup_runs_fresh_processes_first_then_cached(capsys):
    results = startup.run_startup(None, max_model_len=512, num_iters=1)
    assert results["model"].endswith(".gguf") and len(results["cached"]) == 1
    for run in (results["first"], *results["cached"]):
        parts = run["import_s"] + run["llm_s"] + run["first_token_s"]
        assert 0 < parts <= run["total_s"] + 1e-6 and run["total_s"] - parts < 0.01
        assert run["import_s"] > 0 and run["llm_s"] > 0
        # a whole process's memory (torch at least), its peak at or above where it ends
        assert 100 * 2**20 < run["rss_bytes"] <= run["peak_rss_bytes"]


def test_startup_flags():
    import argparse

    parser = argparse.ArgumentParser()
    startup.add_cli_args(parser)
    ns = parser.parse_args(["--model", "m.gguf", "--num-iters", "2", "--max-model-len", "256"])
    assert (ns.model, ns.num_iters, ns.max_model_len, ns.output_json) == ("m.gguf", 2, 256, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-iters", "0"])

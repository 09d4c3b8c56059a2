"""`vlite generate`: a bad flag fails before the model loads; the streamed greedy completion on the real model."""

from __future__ import annotations

import pytest

from tests.entrypoints.cli.utils import GREEDY_FLAGS, run_vlite
from vlite.entrypoints import cli
from vlite.sampling_params import SamplingParams


def test_bad_temperature_fails_before_loading(monkeypatch, capsys):
    def no_load(ns):
        raise AssertionError("the model must not load for a bad sampling flag")

    monkeypatch.setattr("vlite.entrypoints.cli.generate.load_engine", no_load)
    assert cli.main(["generate", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "temperature" in err


@pytest.mark.slow
def test_generate_streams_the_greedy_completion(reference_llm):
    prompt = "The capital of France is"
    proc = run_vlite("generate", prompt, *GREEDY_FLAGS)
    assert proc.returncode == 0, proc.stderr
    expected = reference_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert expected[0].outputs[0].text
    assert proc.stdout == expected[0].outputs[0].text + "\n"
    assert proc.stderr == ""  # quiet: no progress bars or warnings when stderr is not a tty

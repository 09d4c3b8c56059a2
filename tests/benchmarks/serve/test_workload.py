"""`vlite.benchmarks.serve.workload`: the arrival schedule and where the random prompts' vocabulary comes from."""

from __future__ import annotations

import math
import statistics

import pytest

from vlite.benchmarks.serve.workload import arrival_times, tokenizer_model_for


def test_arrival_times_inf_all_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_arrival_times_poisson_seeded_mean_rate():
    times = arrival_times(20001, rate=5.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)  # mean gap 1/rate
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert len(gaps) / times[-1] == pytest.approx(5.0, rel=0.03)
    assert arrival_times(50, 5.0, seed=1) == times[:50]  # seeded: the same prefix
    assert arrival_times(50, 5.0, seed=2) != times[:50]


def test_arrival_times_burstiness_keeps_the_mean():
    times = arrival_times(20001, rate=10.0, seed=0, burstiness=4.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)  # gamma: 1/sqrt(k)


def test_arrival_times_rejects():
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0.0)


def test_tokenizer_choice():
    assert tokenizer_model_for("anything", None, "some/repo") == (True, "some/repo")
    assert tokenizer_model_for("SmolLM2-135M-Instruct.Q4_1", None, None) == (True, None)  # vlite serve's id
    assert tokenizer_model_for("alias", "SmolLM2-135M-Instruct.Q4_1.gguf", None) == (True, None)  # its root
    assert tokenizer_model_for("org/not-local", "not-local", None) == (False, None)


def test_tokenizer_choice_local_path(tmp_path):
    assert tokenizer_model_for(str(tmp_path), None, None) == (True, str(tmp_path))

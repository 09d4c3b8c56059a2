"""Hypothesis fuzzing of SamplingParams: any value of any field is accepted or refused with a
ValueError naming that field, and an accepted one survives the engine's vocabulary check and the
sampler's batch arrays (no TypeError, OverflowError or silent garbage)."""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.sampling_params import SamplingParams
from vlite.worker.input_batch import InputBatch

VOCAB = 1000
FIELDS = [f.name for f in fields(SamplingParams) if not f.name.startswith("_") and f.name != "output_kind"]

anything = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=VOCAB + 5), max_size=4),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.integers(min_value=-5, max_value=VOCAB + 5), st.floats(allow_nan=True), max_size=3),
    st.sampled_from([0, 1, -1, 0.5, 1.0, 2, 64, 1e-9, 1e9]),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), anything, max_size=4))
def test_any_field_value_is_accepted_or_refused_by_name(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert any(name in str(e) for name in kwargs), f"{e!r} names none of {sorted(kwargs)}"
        return
    # Accepted: numeric fields are finite and in range, and the batch arrays take them as they are.
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert math.isfinite(getattr(params, name)), name
    assert params.n >= 1 and (params.max_tokens is None or params.max_tokens >= 1
                              or (params.max_tokens == 0 and params.prompt_logprobs is not None))
    try:
        params.verify_vocab(VOCAB)
    except ValueError as e:
        assert "vocabulary" in str(e)
        return
    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_blocks_per_req=4, vocab_size=VOCAB)
    row = batch.add_request("r", [1, 2, 3], 3, 0, [0], params)
    assert np.isfinite(batch.temperature[row]) and batch.top_k[row] >= 0
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert np.isfinite(getattr(batch, name)[row]), name


def test_values_beyond_float32_are_refused_by_name():
    """Found by hypothesis: 3.4028235677973366e+38 is a finite double but inf as the runner's float32."""
    with pytest.raises(ValueError, match="temperature must be a finite number within float32 range"):
        SamplingParams(temperature=3.4028235677973366e38)
    assert SamplingParams(temperature=3.4028234663852886e38).temperature > 0  # float32's largest: accepted


def test_max_tokens_zero_only_with_prompt_logprobs():
    """0 scores the prompt without generating: meaningless (and refused) without prompt_logprobs."""
    with pytest.raises(ValueError, match="max_tokens must be .* at least 1 .0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1, prompt_logprobs=0)

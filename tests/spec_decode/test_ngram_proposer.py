"""NgramProposer against a plain-Python reference: longest n-gram ending the tokens that occurred
before, its most recent earlier occurrence, the tokens that followed it (repeating their period where
they reach the end), and how long the matched context is."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.config import SpeculativeConfig
from vlite.spec_decode import ngram_proposer
from vlite.spec_decode.ngram_proposer import MAX_MATCH_LEN, NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int, cap: int) -> tuple[list[int], int]:
    t = len(tokens)
    for n in range(min(max_n, t - 1), min_n - 1, -1):
        suffix = tokens[t - n:]
        for start in range(t - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start:start + n] == suffix:
                pos = start + n
                follow = [tokens[pos + i % (t - pos)] for i in range(min(k, cap))]
                match_len = 0
                while match_len < MAX_MATCH_LEN and pos - 1 - match_len >= 0 and \
                        tokens[pos - 1 - match_len] == tokens[t - 1 - match_len]:
                    match_len += 1
                return follow, match_len
    return [], 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=5),
       st.integers(1, 5), st.integers(1, 4), st.integers(0, 3), st.integers(0, 6))
def test_matches_reference(rows, k, min_n, extra, cap):
    max_n = min_n + extra
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=min_n,
                                               prompt_lookup_max=max_n))
    width = max(len(r) for r in rows) + 3
    token_ids = np.full((len(rows), width), 99, dtype=np.int64)  # junk past each row's tokens
    for i, r in enumerate(rows):
        token_ids[i, :len(r)] = r
    num_tokens = np.array([len(r) for r in rows])
    drafts, num_drafts, match_len = proposer.propose(token_ids, num_tokens, np.full(len(rows), cap))
    for i, r in enumerate(rows):
        want = reference(r, k, min_n, max_n, cap)
        assert (drafts[i, :num_drafts[i]].tolist(), match_len[i]) == want, (r, i)
        # alone (the single-stream path) as in a batch: its few candidates in plain Python, and all of
        # them through the vectorized steps
        for few in (ngram_proposer.FEW_CANDIDATES, 0):
            with mock.patch.object(ngram_proposer, "FEW_CANDIDATES", few):
                one = proposer.propose(token_ids[i:i + 1], num_tokens[i:i + 1], np.array([cap]))
            assert (one[0][0, :one[1][0]].tolist(), one[2][0]) == want, (r, "alone", few)
            assert one[0][0, one[1][0]:].tolist() == [0] * (k - one[1][0])


def test_copy_and_no_match():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3))
    token_ids = np.array([[10, 11, 12, 13, 14, 15, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    drafts, num_drafts, match_len = proposer.propose(token_ids, np.array([9, 9]), np.array([4, 4]))
    assert drafts[0].tolist() == [13, 14, 15, 10] and num_drafts.tolist() == [4, 0] and match_len.tolist() == [3, 0]


def test_a_repeating_tail_drafts_its_period():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=7, prompt_lookup_min=2, prompt_lookup_max=3))
    token_ids = np.array([[9, 1, 2, 3, 1, 2, 3, 1, 2]])
    drafts, num_drafts, match_len = proposer.propose(token_ids, np.array([9]), np.array([7]))
    assert drafts[0].tolist() == [3, 1, 2, 3, 1, 2, 3] and match_len.tolist() == [5]


@pytest.mark.parametrize("cfg, message", [
    ({}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be one of"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, r"prompt_lookup_max must be an integer in \[1, 64\]"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys"),
    ("{not json", "must be a JSON object"),
])
def test_config_errors_name_the_field(cfg, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_user(cfg)


def test_config_defaults():
    # neither bound: (2, 4) with the adaptive policy, vLLM's (5, 5) where every match drafts
    c = SpeculativeConfig.from_user('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    c = SpeculativeConfig.from_user({"num_speculative_tokens": 3, "draft_policy": "always"})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    # one bound: vLLM's rule, it is both
    c = SpeculativeConfig.from_user({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_user({"num_speculative_tokens": 3, "prompt_lookup_min": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)

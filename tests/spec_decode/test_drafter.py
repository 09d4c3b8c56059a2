"""Drafter on a real InputBatch: what it proposes after a step, within which limits, and what it records."""

from __future__ import annotations

import numpy as np

from vlite.config import SpeculativeConfig
from vlite.sampling_params import SamplingParams
from vlite.spec_decode.drafter import Drafter
from vlite.worker.input_batch import InputBatch

REPEATING = [7, 1, 2, 3, 1, 2, 3, 1, 2]  # "3 1 2" follows its last "1 2"


def batch_of(*token_lists: list[int]) -> InputBatch:
    batch = InputBatch(4, max_model_len=32, max_blocks_per_req=4, vocab_size=16)
    for i, tokens in enumerate(token_lists):
        batch.add_request(f"r{i}", tokens, 2, len(tokens) - 1, [0], SamplingParams())
    return batch


def drafter(**config) -> Drafter:
    spec = SpeculativeConfig.from_user({"num_speculative_tokens": 3, "draft_policy": "always", **config})
    asked = []
    d = Drafter(spec, lambda max_tokens: asked.append(max_tokens))  # None: DraftPolicy's default cost model
    assert asked == [max(4, spec.max_verify_tokens)]  # the cost model for every step size it may verify
    return d


def test_proposes_the_continuation_of_the_last_match_and_records_the_step():
    batch = batch_of(REPEATING)
    rows, none = np.array([0]), np.zeros(1, dtype=np.int64)
    assert drafter().propose(batch, ["r0"], rows, none, none) == {"r0": [3, 1, 2]}
    assert batch.spec_match_len[0] > 0
    # the step's verified drafts go into the request's record: 1 of 3 accepted, the run ended by a rejection
    drafter().propose(batch, ["r0"], rows, np.array([3]), np.array([1]))
    assert (batch.spec_accepted[0], batch.spec_rejected[0]) == (1.0, 1.0)


def test_drafts_within_the_step_budget_and_the_batch_size():
    batch = batch_of(REPEATING, REPEATING)
    rows, none = np.array([0, 1]), np.zeros(2, dtype=np.int64)
    # 4 verify tokens: the two sampled tokens and two drafts, the first request's
    assert drafter(max_num_batched_draft_tokens=4).propose(batch, ["r0", "r1"], rows, none, none) == {"r0": [3, 1]}
    assert drafter(max_num_batched_draft_tokens=2).propose(batch, ["r0", "r1"], rows, none, none) == {}
    assert drafter(disable_by_batch_size=1).propose(batch, ["r0", "r1"], rows, none, none) == {}
    assert drafter().propose(batch, ["r0", "r1"], rows, none, none) == {"r0": [3, 1, 2], "r1": [3, 1, 2]}

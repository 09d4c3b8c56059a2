"""The per-request checks of each step's output (vlite/core/sched/utils.py) and the policy setting."""

from __future__ import annotations

import pytest

from tests.core.sched.test_scheduler import make_req
from vlite.core.sched.request_queue import SchedulingPolicy
from vlite.core.sched.utils import check_stop, usable_drafts
from vlite.request import RequestStatus


def _with_outputs(req, tokens):
    req.append_output_token_ids(list(tokens))
    return req


def test_check_stop_eos_stop_ids_min_tokens_and_lengths():
    assert check_stop(_with_outputs(make_req("a", 3, eos=(7,)), [7]), 100)
    assert not check_stop(_with_outputs(make_req("b", 3, eos=(7,), ignore_eos=True, max_tokens=9), [7]), 100)
    r = _with_outputs(make_req("c", 3, eos=(7,), min_tokens=2, max_tokens=9), [7])
    assert not check_stop(r, 100) and r.status != RequestStatus.FINISHED_STOPPED  # EOS before min_tokens
    r = _with_outputs(make_req("d", 3, stop_token_ids=[5], max_tokens=9), [1, 5])
    assert check_stop(r, 100) and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 5
    r = _with_outputs(make_req("e", 3, max_tokens=2), [1, 2])
    assert check_stop(r, 100) and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    r = _with_outputs(make_req("f", 3, max_tokens=50), [1])
    assert check_stop(r, 4) and r.status == RequestStatus.FINISHED_LENGTH_CAPPED  # max_model_len


def test_usable_drafts_stop_at_max_tokens_and_max_model_len():
    r = _with_outputs(make_req("a", 3, max_tokens=5), [1])  # 4 more tokens: 1 sampled + 3 drafts
    assert usable_drafts(r, [9, 9, 9, 9, 9], 100) == [9, 9, 9]
    assert usable_drafts(r, [9, 9, 9, 9, 9], 6) == [9]  # 4 tokens now, 2 to go: 1 sampled + 1 draft
    assert usable_drafts(r, [], 100) == []


def test_scheduling_policy_parse():
    assert SchedulingPolicy.parse(" Priority ") is SchedulingPolicy.PRIORITY
    assert SchedulingPolicy.parse(SchedulingPolicy.FCFS) is SchedulingPolicy.FCFS
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \['fcfs', 'priority'\], got 'lifo'"):
        SchedulingPolicy.parse("lifo")

"""DraftPolicy: more drafts the more a request's drafts are accepted, none once they keep failing,
a retry after the evidence decays, and a prior learned per matched-context length."""

from __future__ import annotations

import numpy as np

from vlite.spec_decode.draft_policy import VERIFY_OVERHEAD, DraftPolicy, step_cost


def test_more_drafts_at_higher_acceptance_and_none_when_they_fail():
    p = DraftPolicy(8)
    best = [int(p._best[round(a * 100)]) for a in (0.1, 0.4, 0.6, 0.8, 0.95)]
    assert best == sorted(best) and best[0] == 0 and best[-1] == 8
    # each choice maximizes tokens per unit of step time among 0..8 drafts
    for a in (0.3, 0.55, 0.75, 0.9):
        m = np.arange(9)
        rate = np.cumsum(a ** m) / (step_cost(m + 1) + np.where(m > 0, VERIFY_OVERHEAD, 0.0))
        assert int(p._best[round(a * 100)]) == int(np.argmax(rate))


def test_counts_follow_outcomes_and_decay():
    p = DraftPolicy(8)
    acc, rej, match_len = np.zeros(2), np.zeros(2), np.array([5, 2])  # two buckets: no shared prior
    assert p.num_drafts(acc, rej, match_len).tolist() == [2, 2]  # the prior
    for _ in range(6):  # request 0: every draft accepted; request 1: every first draft rejected
        drafts = p.num_drafts(acc, rej, match_len)
        acc, rej = p.update(acc, rej, drafts, np.array([drafts[0], 0]), match_len)
    assert p.num_drafts(acc, rej, match_len).tolist() == [8, 0]
    steps = 0
    while p.num_drafts(acc, rej, match_len)[1] == 0:  # no drafts, no evidence: it decays back to the prior
        acc, rej = p.update(acc, rej, np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64), match_len)
        steps += 1
    assert 2 <= steps <= 40


def test_a_batch_drafts_only_when_the_whole_step_pays():
    # costs of 1..16 tokens: flat up to 4 (one row tile), then ~0.45 a tile, as measured on Zen 4
    cost = np.array([1.0, 1.07, 1.12, 1.2, 1.55, 1.6, 1.7, 1.9, 2.5, 2.6, 2.7, 2.8, 3.5, 3.6, 3.7, 3.8])
    p = DraftPolicy(8, cost, max_tokens=16)
    high = (np.full(4, 20.0), np.zeros(4))  # acceptance ~0.9
    low = (np.full(4, 1.0), np.full(4, 3.0))  # acceptance ~0.43
    m4, m1 = np.full(4, 5), np.full(1, 5)
    assert p.batch_pays(*high, m4, np.array([1, 1, 1, 1]))  # 8 tokens for ~7.9
    assert not p.batch_pays(*low, m4, np.array([1, 1, 1, 1]))
    assert not p.batch_pays(*high, m4, np.array([5, 5, 5, 5]))  # 24 tokens: past the measured steps
    assert p.batch_pays(np.zeros(1), np.full(1, 50.0), m1, np.array([3]))  # one request: its own choice


def test_the_prior_learns_how_right_drafts_of_each_matched_context_length_are():
    p = DraftPolicy(8)
    fresh = np.zeros(2)
    match_len = np.array([2, 20])  # a short match, the middle of a copy
    assert p.num_drafts(fresh, fresh, match_len).tolist() == [2, 2]
    for _ in range(30):  # other requests' outcomes: short matches fail at once, long ones all hold
        p.update(np.zeros(2), np.zeros(2), np.array([4, 8]), np.array([0, 8]), match_len)
    assert p.num_drafts(fresh, fresh, match_len).tolist() == [0, 8]
    # a request's own record still counts: one whose long-match drafts failed drafts less
    assert p.num_drafts(np.zeros(1), np.full(1, 4.0), match_len[1:])[0] < 8

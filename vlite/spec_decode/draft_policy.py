"""DraftPolicy: how many drafts each request should verify, from how often such drafts were right.

Verifying is not free on a CPU: a step over q tokens of one request costs cost(q) single-token steps,
measured by the runner at start-up (vlite.spec_decode.verify_cost). SmolLM2-135M Q4_1 on 2 Zen 4
cores: ~1.3x for 4 tokens, ~1.6x for 6, ~2.2x for 9 (integer kernels bound by their arithmetic, and
the logits of every verified position). With per-token acceptance a, m drafts yield
T(m) = 1 + a + ... + a^m tokens, so the rate is T(m) / cost(1 + m): m = 8 pays ~3.5x at a = 0.95,
m = 3 ~1.5x at a = 0.6, and below a ~ 0.4 drafting loses. Each request drafts the m that maximizes
its rate, which is 0 when its drafts keep being wrong.

The estimate of a has two parts:
- what drafts with the same matched context length (NgramProposer's match_len, in buckets
  < 4, < 8, < 16, >= 16 tokens) achieved lately, over all requests: in the middle of a copy (16+
  matching tokens) ~95% of drafts are right, after a 2-3 token match ~30% (measured on the copy
  dataset of `vlite bench`); counts decayed by 0.98 at every update, from a prior of 0.6;
- the request's own accepted and rejected draft tokens (a draft run ends at its first rejection),
  decayed by 0.9 every step it samples, with that bucket estimate as its prior (weight 2).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
DECAY = 0.9
MATCH_BUCKETS = np.array([4, 8, 16])  # match_len bucket edges
BUCKET_DECAY = 0.98
# A batch of several requests drafts only when the model predicts at least this much more output per
# unit of step time: there the first rows of a step are no longer nearly free (a step of 4 decodes
# already fills a row tile), and a wrong guess slows every request in it.
MIN_BATCH_GAIN = 1.2
# What a verify step costs beyond its forward (the only part timed at start-up): building its decode
# rows, the rejection sampler, appending several tokens; ~0.3 ms of a ~6 ms step here.
VERIFY_OVERHEAD = 0.05


def step_cost(num_tokens: np.ndarray) -> np.ndarray:
    """A fallback cost model (single-token steps for `num_tokens` verified tokens of one request)
    where none was measured: a straight line through the figures above."""
    return 1.0 + 0.15 * (np.maximum(num_tokens, 1) - 1)  # plus VERIFY_OVERHEAD, added by DraftPolicy


class DraftPolicy:
    def __init__(self, max_drafts: int, cost: Optional[np.ndarray] = None, grid: int = 100,
                 max_tokens: Optional[int] = None) -> None:
        """cost[q - 1]: the cost of a step of q tokens (q = 1..max_tokens, at least max_drafts + 1), relative
        to q = 1."""
        self.grid = grid
        m = np.arange(max_drafts + 1)
        max_tokens = max(max_tokens or 0, max_drafts + 1)
        if cost is None:
            cost = step_cost(np.arange(1, max_tokens + 1))
        assert len(cost) >= max_drafts + 1
        # More tokens never cost less: a timing disturbed upwards is capped by the cheaper larger steps.
        cost = np.minimum.accumulate(np.asarray(cost, dtype=np.float64)[::-1])[::-1]
        self.cost = cost / cost[0]
        self.cost[1:] += VERIFY_OVERHEAD
        a = np.linspace(0.0, 1.0, grid + 1)[:, None]
        expected = np.cumsum(a ** m[None, :], axis=1)  # T(m) = sum_{i<=m} a^i
        # best draft count for each acceptance on the grid
        self._best = np.argmax(expected / self.cost[None, :max_drafts + 1], axis=1)
        self.bucket_accepted = np.zeros(len(MATCH_BUCKETS) + 1)
        self.bucket_rejected = np.zeros(len(MATCH_BUCKETS) + 1)

    def acceptance(self, accepted: np.ndarray, rejected: np.ndarray, match_len: np.ndarray) -> np.ndarray:
        bucket = np.searchsorted(MATCH_BUCKETS, match_len, side="right")
        ba, br = self.bucket_accepted[bucket], self.bucket_rejected[bucket]
        prior = (ba + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (ba + br + PRIOR_WEIGHT)
        return (accepted + prior * PRIOR_WEIGHT) / (accepted + rejected + PRIOR_WEIGHT)

    def num_drafts(self, accepted: np.ndarray, rejected: np.ndarray, match_len: np.ndarray) -> np.ndarray:
        """The draft count that maximizes each request's tokens per unit of step time."""
        a = self.acceptance(accepted, rejected, match_len)
        return self._best[np.rint(a * self.grid).astype(np.int64)]

    def batch_pays(self, accepted: np.ndarray, rejected: np.ndarray, match_len: np.ndarray,
                   num_drafts: np.ndarray) -> bool:
        """Whether a step of several requests with these drafts is predicted to give MIN_BATCH_GAIN more
        tokens per unit of time than the step without them (one request: its own choice, always)."""
        num_reqs = len(num_drafts)
        rows = num_reqs + int(num_drafts.sum())
        if num_reqs <= 1:
            return True
        if rows > len(self.cost):
            return False
        a = self.acceptance(accepted, rejected, match_len)
        expected = float(np.sum((1 - a ** (num_drafts + 1)) / np.maximum(1 - a, 1e-9)))
        return expected / self.cost[rows - 1] >= MIN_BATCH_GAIN * num_reqs / self.cost[num_reqs - 1]

    def update(self, accepted: np.ndarray, rejected: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray,
               match_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """After a step: the match-length buckets learn from the requests that verified drafts; returns the
        requests' counts, decayed, plus the drafts accepted and the one that ended the run (if any)."""
        ended = num_accepted < num_drafts
        drafted = num_drafts > 0
        if drafted.any():
            bucket = np.searchsorted(MATCH_BUCKETS, match_len[drafted], side="right")
            self.bucket_accepted *= BUCKET_DECAY
            self.bucket_rejected *= BUCKET_DECAY
            np.add.at(self.bucket_accepted, bucket, num_accepted[drafted])
            np.add.at(self.bucket_rejected, bucket, ended[drafted])
        return DECAY * accepted + num_accepted, DECAY * rejected + ended

"""DraftPolicy: how many drafts each request should verify, from its own acceptance so far.

Verifying is not free on a CPU: a step over q tokens of one request costs cost(q) single-token steps,
measured by the runner at start-up (`ModelRunner._measure_verify_cost`). SmolLM2-135M Q4_1 on 2 Zen 4
cores: 5.4 ms for 1 token, 7.8 for 2-4, 10.4 for 5-8, 15.4 for 9, 22.0 for 17 (row tiles of 4 in the
integer kernels, and the logits of every verified position). With per-token acceptance a, m drafts
yield T(m) = 1 + a + ... + a^m tokens, so the rate is T(m) / cost(1 + m): m = 7 pays ~2.2x at
a = 0.9, m = 3 ~1.5x at a = 0.6, and below a ~ 0.4 drafting loses. Each request drafts the m that
maximizes its rate, which is 0 when its drafts keep being rejected.

The estimate of a: accepted and rejected draft tokens (a draft run ends at its first rejection), with
a prior of 0.6 (weight 2), both counts decayed by 0.9 every step the request samples: a request whose
drafts stopped paying tries again after a while (text that starts to repeat its prompt later).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
DECAY = 0.9
# A batch of several requests drafts only when the model predicts at least this much more output per
# unit of step time: there the first rows of a step are no longer nearly free (a step of 4 decodes
# already fills a row tile), and a wrong guess slows every request in it.
MIN_BATCH_GAIN = 1.2


def step_cost(num_tokens: np.ndarray) -> np.ndarray:
    """A fallback cost model (single-token steps for `num_tokens` verified tokens of one request)
    where none was measured: a straight line through the figures above."""
    return np.where(num_tokens <= 1, 1.0, 1.45 + 0.2 * (num_tokens - 2))


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
        a = np.linspace(0.0, 1.0, grid + 1)[:, None]
        expected = np.cumsum(a ** m[None, :], axis=1)  # T(m) = sum_{i<=m} a^i
        # best draft count for each acceptance on the grid
        self._best = np.argmax(expected / self.cost[None, :max_drafts + 1], axis=1)

    @staticmethod
    def acceptance(accepted: np.ndarray, rejected: np.ndarray) -> np.ndarray:
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (accepted + rejected + PRIOR_WEIGHT)

    def num_drafts(self, accepted: np.ndarray, rejected: np.ndarray) -> np.ndarray:
        """The draft count that maximizes each request's tokens per unit of step time."""
        a = self.acceptance(accepted, rejected)
        return self._best[np.rint(a * self.grid).astype(np.int64)]

    def batch_pays(self, accepted: np.ndarray, rejected: np.ndarray, num_drafts: np.ndarray) -> bool:
        """Whether a step of several requests with these drafts is predicted to give MIN_BATCH_GAIN more
        tokens per unit of time than the step without them (one request: its own choice, always)."""
        num_reqs = len(num_drafts)
        rows = num_reqs + int(num_drafts.sum())
        if num_reqs <= 1:
            return True
        if rows > len(self.cost):
            return False
        a = self.acceptance(accepted, rejected)
        expected = float(np.sum((1 - a ** (num_drafts + 1)) / np.maximum(1 - a, 1e-9)))
        return expected / self.cost[rows - 1] >= MIN_BATCH_GAIN * num_reqs / self.cost[num_reqs - 1]

    @staticmethod
    def update(accepted: np.ndarray, rejected: np.ndarray, num_drafts: np.ndarray,
               num_accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Counts after a step: decayed, plus the drafts accepted and the one that ended the run (if any)."""
        return (DECAY * accepted + num_accepted,
                DECAY * rejected + (num_accepted < num_drafts))

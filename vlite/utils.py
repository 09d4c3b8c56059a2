"""Small array helpers shared by the runner, the samplers and the attention backends."""

from __future__ import annotations

import numpy as np


def group_offsets(counts: np.ndarray) -> np.ndarray:
    """Each element's index within its group, for consecutive groups of `counts` elements:
    [2, 3] -> [0, 1, 0, 1, 2] (a request's tokens within the step, a row within its request's rows)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)

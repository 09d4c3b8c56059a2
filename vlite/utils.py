"""Small helpers shared across packages: arrays (the runner, the samplers, the attention backends), id lists
(the config parsers), streamed text (the tool and reasoning parsers)."""

from __future__ import annotations

from typing import Any

import numpy as np


def group_starts(counts: np.ndarray) -> np.ndarray:
    """The index of each group's first element, for consecutive groups of `counts` elements:
    [2, 3] -> [0, 2] (a request's first logits row, a request's first token in the step)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.cumsum(counts) - counts


def group_offsets(counts: np.ndarray) -> np.ndarray:
    """Each element's index within its group, for consecutive groups of `counts` elements:
    [2, 3] -> [0, 1, 0, 1, 2] (a request's tokens within the step, a row within its request's rows)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum())) - np.repeat(group_starts(counts), counts)


def extend_ids(out: list[int], value: Any) -> None:
    """Append an int or list of ints (a config's ``eos_token_id``) to ``out``, keeping order and skipping duplicates."""
    if value is None:
        return
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if v is not None and int(v) not in out:
            out.append(int(v))


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker` (kept back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0

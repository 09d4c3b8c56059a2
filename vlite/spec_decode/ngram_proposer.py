"""NgramProposer: prompt-lookup drafts, found for the whole batch at once with numpy.

For each request, the longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that ends its
tokens (prompt + output) and occurred before is looked up; the tokens that followed its most recent
earlier occurrence are the drafts (at most num_speculative_tokens, only tokens already known).
A request without such a match gets none.

    tokens:  the cat sat on the mat . the cat sat  |  suffix "the cat sat" (n = 3) occurred at 0..2
    drafts:  on the mat .                          |  the tokens that followed it

Matching is one comparison per n over a [B, L] window: for every position e, whether the token
j places before e equals the token j places before the end, accumulated over j = 1..max_n.
"""

from __future__ import annotations

import numpy as np

from vlite.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, max_drafts: np.ndarray) -> tuple[np.ndarray,
                                                                                                      np.ndarray]:
        """token_ids [B, >= max(num_tokens)], num_tokens [B], max_drafts [B] (caps per request).

        Returns (drafts [B, k] int64, num_drafts [B]); row b's drafts are drafts[b, :num_drafts[b]].
        """
        num_reqs = len(num_tokens)
        drafts = np.zeros((num_reqs, self.k), dtype=np.int64)
        if num_reqs == 0:
            return drafts, np.zeros(0, dtype=np.int64)
        length = int(num_tokens.max())
        tokens = token_ids[:, :length]
        rows = np.arange(num_reqs)
        # match[b, e]: how many tokens before position e equal the last ones of row b (up to max_n);
        # a match at e proposes tokens[b, e:]. e == num_tokens is the suffix itself: excluded.
        match = np.zeros((num_reqs, length), dtype=np.int16)
        alive = np.ones((num_reqs, length), dtype=bool)
        alive[:, 0] = False
        for j in range(1, min(self.max_n, length - 1) + 1):
            last = tokens[rows, np.maximum(num_tokens - j, 0)]
            alive[:, j:] &= tokens[:, :length - j] == last[:, None]
            alive[:, :j] = False
            alive[num_tokens - j < 0] = False
            match += alive
        match[np.arange(length)[None, :] >= num_tokens[:, None]] = 0
        best = match.max(axis=1)
        found = best >= self.min_n
        # The most recent occurrence of the longest match.
        pos = length - 1 - np.argmax((match == best[:, None])[:, ::-1], axis=1)
        num_drafts = np.where(found, np.minimum(np.minimum(num_tokens - pos, self.k), max_drafts), 0)
        num_drafts = np.maximum(num_drafts, 0)
        idx = np.minimum(pos[:, None] + np.arange(self.k)[None, :], length - 1)
        drafts[:] = np.where(np.arange(self.k)[None, :] < num_drafts[:, None], tokens[rows[:, None], idx], 0)
        return drafts, num_drafts

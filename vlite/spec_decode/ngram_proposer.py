"""NgramProposer: prompt-lookup drafts, found for the whole batch at once with numpy.

For each request, the longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that ends its
tokens (prompt + output) and occurred before is looked up; the tokens that followed its most recent
earlier occurrence are the drafts (at most num_speculative_tokens). A request without such a match
gets none.

    tokens:  the cat sat on the mat . the cat sat  |  suffix "the cat sat" (n = 3) occurred at 0..2
    drafts:  on the mat .                          |  the tokens that followed it

Where those tokens run into the end of the sequence (the match is its own recent past, p tokens
back: text repeating itself), the drafts go on repeating that period, as the text would:

    tokens:  x a b c a b c a b        |  "c a b" occurred 3 back: drafts c a b c a b ...

With the drafts comes `match_len`: how many tokens before the continuation equal the ones before
the end (the n-gram and what precedes it alike, up to MAX_MATCH_LEN). A long one means the text is in the middle of
a copy, where drafts are nearly always right; DraftPolicy learns how right for each length.

Matching is one comparison per n over a [B, L] window: for every position e, whether the token
j places before e equals the token j places before the end, accumulated over j = 1..max_n.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from vlite.config import SpeculativeConfig

MAX_MATCH_LEN = 32
FEW_CANDIDATES = 8  # _propose_one: up to this many candidates in plain Python


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray,
                max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """token_ids [B, >= max(num_tokens)], num_tokens [B], max_drafts [B] (caps per request).

        Returns (drafts [B, k] int64, num_drafts [B], match_len [B]); row b's drafts are
        drafts[b, :num_drafts[b]].
        """
        num_reqs = len(num_tokens)
        if num_reqs == 1:
            return self._propose_one(token_ids[0, :int(num_tokens[0])], int(max_drafts[0]))
        drafts = np.zeros((num_reqs, self.k), dtype=np.int64)
        if num_reqs == 0:
            return drafts, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        length = int(num_tokens.max())
        tokens = token_ids[:, :length]
        rows = np.arange(num_reqs)
        # Candidates: positions e (1 <= e < num_tokens) whose previous token equals the last one; a
        # match at e proposes tokens[b, e:] (e == num_tokens is the suffix itself). Only they are
        # extended to longer n-grams: a few per row, where comparing every position for every n cost
        # ~100 us a step on a 500-token sequence.
        cand_b, cand_e = np.nonzero((tokens[:, :length - 1] == tokens[rows, num_tokens - 1][:, None])
                                    & (np.arange(1, length)[None, :] < num_tokens[:, None]))
        nothing = drafts, np.zeros(num_reqs, dtype=np.int64), np.zeros(num_reqs, dtype=np.int64)
        if not len(cand_b):  # common in text that does not repeat: done in a few microseconds
            return nothing
        cand_e = cand_e + 1
        # match: 1 + how many of the n - 1 tokens before those agree too, all n at once
        match = 1 + _agreeing_run(tokens, cand_b, cand_e - 1, num_tokens[cand_b] - 1, self.max_n - 1)
        # Per row, the longest match and, among those, its most recent occurrence (largest e).
        key = np.full(num_reqs, -1, dtype=np.int64)
        np.maximum.at(key, cand_b, match * (length + 1) + cand_e)
        best, pos = np.where(key >= 0, key // (length + 1), 0), np.where(key >= 0, key % (length + 1), 0)
        found = best >= self.min_n
        if not found.any():
            return nothing
        # Its continuation repeats with period num_tokens - pos where it reaches the end.
        period = np.maximum(num_tokens - pos, 1)
        num_drafts = np.where(found, np.minimum(self.k, max_drafts), 0)
        num_drafts = np.maximum(num_drafts, 0)
        idx = np.minimum(pos[:, None] + np.arange(self.k)[None, :] % period[:, None], length - 1)
        drafts[:] = np.where(np.arange(self.k)[None, :] < num_drafts[:, None], tokens[rows[:, None], idx], 0)
        # The matched context: tokens before pos that equal those before the end (pos - j vs n - j).
        match_len = np.where(found, _agreeing_run(tokens, rows, pos, num_tokens, MAX_MATCH_LEN), 0)
        return drafts, num_drafts, match_len

    def _propose_one(self, seq: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """propose() for one request (a single stream, where drafting pays most): the same steps on
        1-D arrays, in a third of the numpy calls (~35 us a step instead of ~130 on a 400-token sequence).
        Up to FEW_CANDIDATES candidates (the usual case) are extended in plain Python over a few
        tokens each (~12 us a step instead of ~45: every numpy call costs microseconds, more so with the
        caches cold after a forward)."""
        drafts = np.zeros((1, self.k), dtype=np.int64)
        none = np.zeros(1, dtype=np.int64)
        n = len(seq)
        cand = np.flatnonzero(seq[:n - 1] == seq[n - 1])  # e - 1 for the candidate positions e
        if not cand.size:
            return drafts, none, none
        if cand.size <= FEW_CANDIDATES:
            mx = self.max_n
            suffix = seq[max(0, n - mx):n].tolist()[::-1]  # suffix[j]: the token j before the end
            best, at = 0, -1
            for c in reversed(cand.tolist()):  # the most recent first: it keeps ties
                m = _leading_equal(seq[max(0, c - mx + 1):c + 1].tolist()[::-1], suffix)  # seq[c] is the last
                if m > best:
                    best, at = m, c
                    if m == mx:
                        break
            if best < self.min_n:
                return drafts, none, none
            pos = at + 1
            before = seq[max(0, pos - MAX_MATCH_LEN):pos].tolist()[::-1]
            match_len = np.array([_leading_equal(before, seq[n - len(before):n].tolist()[::-1])])
        else:
            match = 1 + _agreeing_run(seq, None, cand, n - 1, self.max_n - 1)
            i = int(np.argmax(match * (n + 1) + cand))  # the longest, then the most recent
            if match[i] < self.min_n:
                return drafts, none, none
            pos = int(cand[i]) + 1
            match_len = _agreeing_run(seq, None, np.array([pos]), n, MAX_MATCH_LEN)
        num = max(0, min(self.k, cap))
        j = np.arange(num)
        drafts[0, :num] = seq[np.minimum(pos + j % max(n - pos, 1), n - 1)]
        return drafts, np.array([num]), match_len


def _leading_equal(a: list[int], b: list[int]) -> int:
    """How many leading items of a equal b's (len(a) <= len(b)): _agreeing_run on two reversed lists."""
    m = 0
    while m < len(a) and a[m] == b[m]:
        m += 1
    return m


def _agreeing_run(tokens: np.ndarray, rows: Optional[np.ndarray], a: np.ndarray, b: Union[np.ndarray, int],
                  limit: int) -> np.ndarray:
    """For each i, how many tokens just before a[i] equal those just before b[i] in row rows[i]
    (tokens[r, a - j] == tokens[r, b - j] for j = 1, 2, ...; a[i] <= b[i]), at most `limit`.
    rows None: `tokens` is one sequence (1-D) and b may be one position for all a."""
    j = np.arange(1, limit + 1)
    before = a[:, None] - j
    at_a, at_b = np.maximum(before, 0), np.maximum(np.asarray(b)[..., None] - j, 0)
    if rows is None:
        same = tokens[at_a] == tokens[at_b]
    else:
        same = tokens[rows[:, None], at_a] == tokens[rows[:, None], at_b]
    return np.cumprod((before >= 0) & same, axis=1).sum(axis=1)

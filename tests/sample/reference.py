"""Reference implementations in plain Python, and fixed inputs, that the sampler (tests/sample) and the
SamplingMetadata InputBatch builds (tests/worker/test_input_batch.py) are tested against."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from vlite.sample.metadata import SamplingMetadata

V = 20  # vocabulary of the distribution tests


# ---- reference implementations ------------------------------------------------------------------


def softmax(xs: list[float]) -> list[float]:
    finite = [x for x in xs if x != -math.inf]
    m = max(finite)
    es = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(es)
    return [e / s for e in es]


def reference_probs(logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> list[float]:
    """The distribution a row must be sampled from: temperature, then min_p, top-k, top-p."""
    n = len(logits)
    if temperature == 0.0:
        best = max(range(n), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(n)]
    z = [x / temperature for x in logits]
    p = softmax(z)
    keep = [True] * n
    if min_p > 0:
        threshold = min_p * max(p)
        for i in range(n):
            # The test data must not sit on the boundary, where float32 rounding decides.
            assert abs(p[i] - threshold) > 1e-6 * max(p), "min_p boundary case in test data"
            keep[i] = p[i] >= threshold
    by_value = sorted(range(n), key=lambda i: -z[i])
    if top_k > 0:
        kept = [i for i in by_value if keep[i]]
        for i in kept[top_k:]:
            keep[i] = False
    p = [p[i] if keep[i] else 0.0 for i in range(n)]
    total = sum(p)
    p = [x / total for x in p]
    if top_p < 1.0:
        cum = 0.0
        for i in by_value:
            if cum >= top_p:
                p[i] = 0.0
            else:
                cum += p[i]
                assert abs(cum - top_p) > 1e-4, "top_p boundary case in test data"
        total = sum(p)
        p = [x / total for x in p]
    return p


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], repetition: float,
                        frequency: float, presence: float) -> list[float]:
    out = list(logits)
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        count = output.count(t)
        out[t] -= frequency * count
        out[t] -= presence
    return out


def reference_processors(logits: list[float], output: list[int], allowed: Optional[list[int]] = None,
                         bad_words: Optional[list[list[int]]] = None, suppress: Optional[list[int]] = None,
                         bias: Optional[dict[int, float]] = None) -> list[float]:
    """allowed_token_ids, bad_words, min_tokens suppression (ids given), logit_bias."""
    out = list(logits)
    if allowed is not None:
        out = [x if i in allowed else -math.inf for i, x in enumerate(out)]
    for word in bad_words or []:
        *prefix, last = word
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            out[last] = -math.inf
    for t in suppress or []:
        out[t] = -math.inf
    for t, b in (bias or {}).items():
        out[t] += b
    return out


def padded(lists: list[list[int]], pad: int, min_len: int = 1) -> torch.Tensor:
    """Right-pad with `pad` (= vocab size), as InputBatch._padded_token_ids does."""
    width = max(min_len, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.int64)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of `counts` to `probs`; tokens outside the support must never occur.

    Bins with an expected count under 5 are pooled (smallest first) so the chi-square
    approximation holds.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {np.nonzero(counts * ~support)[0]}"
    obs, exp = list(counts[support]), list(probs[support] * n)
    bins: list[tuple[float, float]] = []
    pool_o = pool_e = 0.0
    for o, e in sorted(zip(obs, exp), key=lambda t: t[1]):
        if e < 5 or pool_e and pool_e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            if pool_e >= 5:
                bins.append((pool_o, pool_e))
                pool_o = pool_e = 0.0
        else:
            bins.append((o, e))
    if pool_e:
        if bins:
            o, e = bins.pop(0)
            bins.append((o + pool_o, e + pool_e))
        else:
            bins.append((pool_o, pool_e))
    if len(bins) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# ---- metadata builder (the same conventions as InputBatch.make_sampling_metadata) --------------


def make_metadata(rows: list[dict], vocab_size: int, generators: Optional[dict[int, torch.Generator]] = None,
                  max_num_logprobs: Optional[int] = None) -> SamplingMetadata:
    temperature = torch.tensor([r.get("temperature", 1.0) for r in rows], dtype=torch.float32)
    greedy = temperature < 1e-5
    top_k = torch.tensor([r.get("top_k", 0) for r in rows], dtype=torch.int64)
    top_p = torch.tensor([r.get("top_p", 1.0) for r in rows], dtype=torch.float32)
    min_p = torch.tensor([r.get("min_p", 0.0) for r in rows], dtype=torch.float32)
    return SamplingMetadata(
        temperature=None if bool(greedy.all()) else temperature,
        all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()),
        top_p=top_p if bool((top_p != 1.0).any()) else None,
        top_k=torch.where(top_k > 0, top_k, vocab_size) if bool((top_k > 0).any()) else None,
        min_p=min_p if bool((min_p != 0.0).any()) else None,
        generators=dict(generators or {}),
        max_num_logprobs=max_num_logprobs,
    )


def fixed_logits(num_rows: int, vocab_size: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.standard_normal((num_rows, vocab_size)) * scale).astype(np.float32))


def row_logits(logits: torch.Tensor, i: int) -> list[float]:
    return [float(x) for x in logits[i].double()]

"""RejectionSampler: keep the draft tokens the target model would have produced, and one token more.

A request verifying m draft tokens d_0..d_{m-1} has m + 1 logits rows: row i is the target's
distribution for the token after d_0..d_{i-1} (processors, penalties and grammar masks were applied
as if those drafts were kept). Draft d_i is accepted while every earlier one was:

    greedy rows:  d_i == argmax(row i)
    random rows:  u_i < p_i(d_i)       (min(1, p/q) with q one-hot on d_i, as n-gram drafts are)

The first rejected position i yields a token from the residual max(0, p_i - q_i), i.e. p_i without
d_i, renormalized (greedy: the argmax); when all m are accepted, a bonus token comes from row m. The
kept tokens are then distributed exactly as tokens sampled one step at a time.

Random draws: a request with m drafts takes m + 1 uniforms per step (m acceptance tests, one sample),
from its own generator when seeded, so its tokens do not depend on the rest of the batch; with no
drafts that is the one uniform of the plain sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vlite.sample.metadata import SamplingMetadata
from vlite.sample.sampler import LogprobsTensors, gather_logprobs, inverse_cdf_sample, process_logits, target_probs


@dataclass
class RejectionSamplerOutput:
    num_accepted: np.ndarray  # [B] drafts kept per request
    output_token_ids: list[list[int]]  # per request: the kept drafts and one token more
    logprobs_tensors: Optional[LogprobsTensors]  # one row per output token, requests in order


def rejection_sample(logits: torch.Tensor, md: SamplingMetadata, num_drafts: np.ndarray, draft_token_ids: np.ndarray,
                     generators: dict[int, torch.Generator]) -> RejectionSamplerOutput:
    """logits [sum(num_drafts + 1), V]: request b's rows are consecutive, md per row.

    num_drafts [B]; draft_token_ids [sum(num_drafts)] flat, requests in order; generators: request
    index -> its generator (seeded requests).
    """
    num_reqs = len(num_drafts)
    max_drafts = int(num_drafts.max()) if num_reqs else 0
    starts = np.zeros(num_reqs, dtype=np.int64)
    np.cumsum(num_drafts[:-1] + 1, out=starts[1:])

    raw_logprobs, logits = process_logits(logits, md)

    # Drafts as a [B, max_drafts] grid (padding never accepted), and the rows that score them.
    has_draft = np.arange(max_drafts)[None, :] < num_drafts[:, None]
    drafts = np.zeros((num_reqs, max_drafts), dtype=np.int64)
    drafts[has_draft] = draft_token_ids
    draft_rows = torch.from_numpy(starts[:, None] + np.arange(max_drafts)[None, :])[torch.from_numpy(has_draft)]
    draft_ids = torch.from_numpy(draft_token_ids.astype(np.int64, copy=False))
    drafts_t = torch.from_numpy(drafts)

    req_greedy = None if md.temperature is None else (md.temperature[torch.from_numpy(starts)] < 1e-5)
    argmax = None if md.all_random else logits.argmax(dim=-1)
    probs = None if md.all_greedy else target_probs(logits, md)
    u = _uniforms(num_drafts, generators) if probs is not None else None

    accept = torch.zeros(num_reqs, max_drafts, dtype=torch.bool)
    if max_drafts:
        ok = torch.empty(len(draft_token_ids), dtype=torch.bool)
        if argmax is not None:
            ok = argmax[draft_rows] == draft_ids
        if probs is not None:
            assert u is not None
            u_accept = u[:, :max_drafts][torch.from_numpy(has_draft)]
            ok_random = u_accept < probs[draft_rows, draft_ids]
            if argmax is None:
                ok = ok_random
            else:
                assert req_greedy is not None
                row_greedy = req_greedy.repeat_interleave(torch.from_numpy(num_drafts))
                ok = torch.where(row_greedy, ok, ok_random)
        accept[torch.from_numpy(has_draft)] = ok
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] up to the first rejection
    final_rows = torch.from_numpy(starts) + num_accepted

    final = None if argmax is None else argmax[final_rows]
    if probs is not None:
        assert u is not None
        p = probs[final_rows]
        rejected = num_accepted < torch.from_numpy(num_drafts)
        if bool(rejected.any()):
            rows = torch.nonzero(rejected).flatten()
            p[rows, drafts_t[rows, num_accepted[rows]]] = 0.0  # the residual of a one-hot draft
            empty = p.sum(dim=-1) <= 0  # p was all on the rejected draft (rounding): keep its argmax
            if bool(empty.any()):
                p[empty] = probs[final_rows[empty]]
        sampled = inverse_cdf_sample(p, u[torch.arange(num_reqs), torch.from_numpy(num_drafts)])
        final = sampled if final is None else torch.where(req_greedy, final, sampled)
    assert final is not None

    n_acc = num_accepted.numpy()
    final_list = final.tolist()
    outputs = [row[:n].tolist() + [f] for row, n, f in zip(drafts, n_acc, final_list)]
    lp = None
    if raw_logprobs is not None:
        # One row per output token: rows starts[b] .. starts[b] + n_acc[b].
        counts = n_acc + 1
        out_rows = np.repeat(starts, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts,
                                                                                     counts))
        tokens = torch.tensor([t for out in outputs for t in out], dtype=torch.int64)
        lp = gather_logprobs(raw_logprobs[torch.from_numpy(out_rows)], md.max_num_logprobs or 0, tokens)
    return RejectionSamplerOutput(n_acc, outputs, lp)


def _uniforms(num_drafts: np.ndarray, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """[B, max_drafts + 1]: request b's acceptance draws in columns 0..m_b-1 and its sample's in column m_b."""
    num_reqs = len(num_drafts)
    width = int(num_drafts.max()) + 1
    u = torch.rand(num_reqs, width) if len(generators) < num_reqs else torch.empty(num_reqs, width)
    for b, gen in generators.items():
        m = int(num_drafts[b])
        u[b, :m + 1] = torch.rand(m + 1, generator=gen)
    return u

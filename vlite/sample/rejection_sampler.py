"""RejectionSampler: keep the draft tokens the target model would have produced, and one token more.

A request verifying m draft tokens d_0..d_{m-1} has m + 1 logits rows: row i is the target's
distribution for the token after d_0..d_{i-1} (processors, penalties and grammar masks were applied
as if those drafts were kept). Draft d_i is accepted while every earlier one was:

    greedy rows:  d_i == argmax(row i)
    random rows:  u_i < p_i(d_i)       (min(1, p/q) with q one-hot on d_i, as n-gram drafts are)

The first rejected position i yields a token from the residual max(0, p_i - q_i), i.e. p_i without
d_i, renormalized (greedy: the argmax); when all m are accepted, a bonus token comes from row m. The
kept tokens are then distributed exactly as tokens sampled one step at a time.

Seeded rows (md.generators: one generator per row, keyed by the request's seed and the token's
position) sample their token t at row i as the plain sampler would (inverse CDF at the generator's
uniform) and accept d_i iff it equals that token. For a one-hot q this is the same rule: d_i is kept
with probability p_i(d_i), and a rejection yields p_i conditioned on not d_i, the residual. It makes a
seeded request's tokens the same with any number of drafts, which depends on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vlite.sample.metadata import SamplingMetadata
from vlite.sample.sampler import (LogprobsTensors, gather_logprobs, greedy_argmax, inverse_cdf_sample, process_logits,
                                  target_probs)
from vlite.utils import group_offsets, group_starts


@dataclass
class RejectionSamplerOutput:
    num_accepted: np.ndarray  # [B] drafts kept per request
    output_token_ids: list[list[int]]  # per request: the kept drafts and one token more
    logprobs_tensors: Optional[LogprobsTensors]  # one row per output token, requests in order


def rejection_sample(logits: torch.Tensor, md: SamplingMetadata, num_drafts: np.ndarray,
                     draft_token_ids: np.ndarray) -> RejectionSamplerOutput:
    """logits [sum(num_drafts + 1), V]: request b's rows are consecutive, md per row.

    num_drafts [B]; draft_token_ids [sum(num_drafts)] flat, requests in order.
    """
    num_reqs = len(num_drafts)
    max_drafts = int(num_drafts.max()) if num_reqs else 0
    starts = group_starts(num_drafts + 1)  # each request's first logits row

    raw_logprobs, logits = process_logits(logits, md)

    # Drafts as a [B, max_drafts] grid (padding never accepted), and the rows that score them.
    has_draft = np.arange(max_drafts)[None, :] < num_drafts[:, None]
    drafts = np.zeros((num_reqs, max_drafts), dtype=np.int64)
    drafts[has_draft] = draft_token_ids
    draft_rows = (starts[:, None] + np.arange(max_drafts)[None, :])[has_draft]
    draft_ids = drafts[has_draft]

    if md.all_greedy:  # the common case, in numpy: a few small-array operations
        target = greedy_argmax(logits).numpy()
        accept = np.zeros((num_reqs, max_drafts), dtype=bool)
        accept[has_draft] = target[draft_rows] == draft_ids
        n_acc = np.cumprod(accept, axis=1).sum(axis=1) if max_drafts else np.zeros(num_reqs, dtype=np.int64)
        final_list = target[starts + n_acc].tolist()
    else:
        n_acc, final_list = _sample_random(logits, md, num_drafts, starts, drafts, has_draft, draft_rows, draft_ids)

    outputs = [row[:n].tolist() + [f] for row, n, f in zip(drafts, n_acc.tolist(), final_list)]
    lp = None
    if raw_logprobs is not None:
        # One row per output token: rows starts[b] .. starts[b] + n_acc[b].
        counts = n_acc + 1
        out_rows = np.repeat(starts, counts) + group_offsets(counts)
        tokens = torch.tensor([t for out in outputs for t in out], dtype=torch.int64)
        lp = gather_logprobs(raw_logprobs[torch.from_numpy(out_rows)], md.max_num_logprobs or 0, tokens)
    return RejectionSamplerOutput(n_acc, outputs, lp)


def _sample_random(logits: torch.Tensor, md: SamplingMetadata, num_drafts: np.ndarray, starts: np.ndarray,
                   drafts_np: np.ndarray, has_draft_np: np.ndarray, draft_rows_np: np.ndarray,
                   draft_ids_np: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Batches with random rows: (drafts accepted per request, the token each ends with)."""
    num_reqs, num_rows = len(num_drafts), logits.shape[0]
    max_drafts = drafts_np.shape[1]
    starts_t, num_drafts_t = torch.from_numpy(starts), torch.from_numpy(num_drafts)
    drafts, has_draft = torch.from_numpy(drafts_np), torch.from_numpy(has_draft_np)
    draft_rows, draft_ids = torch.from_numpy(draft_rows_np), torch.from_numpy(draft_ids_np)
    # Rows whose token is fixed before looking at the draft: greedy ones (argmax) and seeded ones.
    fixed = torch.zeros(num_rows, dtype=torch.int64) if md.all_random else greedy_argmax(logits)
    assert md.temperature is not None
    is_fixed = md.temperature < 1e-5
    probs = target_probs(logits, md)
    gens = {i: g for i, g in md.generators.items() if not is_fixed[i]}
    if gens:
        seeded = torch.tensor(list(gens))
        u = torch.cat([torch.rand(1, generator=g) for g in gens.values()])
        fixed[seeded] = inverse_cdf_sample(probs[seeded], u)
        is_fixed[seeded] = True
    # Unseeded random requests: an acceptance draw per draft and one for the token they end with.
    u_req = torch.rand(num_reqs, max_drafts + 1)

    accept = torch.zeros(num_reqs, max_drafts, dtype=torch.bool)
    if max_drafts:
        ok_random = u_req[:, :max_drafts][has_draft] < probs[draft_rows, draft_ids]
        accept[has_draft] = torch.where(is_fixed[draft_rows], fixed[draft_rows] == draft_ids, ok_random)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] up to the first rejection
    final_rows = starts_t + num_accepted
    final = fixed[final_rows]
    random_final = ~is_fixed[final_rows]
    if bool(random_final.any()):
        reqs = torch.nonzero(random_final).flatten()
        p = probs[final_rows[reqs]]
        rejected = num_accepted[reqs] < num_drafts_t[reqs]
        if bool(rejected.any()):
            r = torch.nonzero(rejected).flatten()
            p[r, drafts[reqs[r], num_accepted[reqs[r]]]] = 0.0  # the residual of a one-hot draft
            empty = p.sum(dim=-1) <= 0  # all of p was on the rejected draft (rounding): sample p itself
            if bool(empty.any()):
                p[empty] = probs[final_rows[reqs[empty]]]
        final[reqs] = inverse_cdf_sample(p, u_req[reqs, num_drafts_t[reqs]])

    return num_accepted.numpy(), final.tolist()

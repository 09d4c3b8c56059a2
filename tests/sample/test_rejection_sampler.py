"""Rejection sampler: greedy keeps the drafts equal to the argmax; random rows keep the target
distribution exactly (chi-square over many draws on a small vocabulary), with seeded requests
independent of the batch."""

from __future__ import annotations

import numpy as np
import torch

from tests.sample.reference import chi_square_pvalue, make_metadata
from vlite.sample.rejection_sampler import rejection_sample
from vlite.sample.sampler import Sampler, seeded_generator

V = 6


def test_greedy_keeps_drafts_up_to_first_mismatch_then_argmax():
    # request 0: drafts [2, 3, 1] vs argmax rows [2, 3, 4, 5] -> keep 2, 3 then 4
    # request 1: no drafts -> argmax 0; request 2: drafts [5] all accepted -> 5 + bonus argmax 1
    argmax = [2, 3, 4, 5, 0, 5, 1]
    logits = torch.full((7, V), -1.0)
    logits[torch.arange(7), torch.tensor(argmax)] = 3.0
    md = make_metadata([{"temperature": 0.0}] * 7, V, max_num_logprobs=0)
    out = rejection_sample(logits, md, np.array([3, 0, 1]), np.array([2, 3, 1, 5]))
    assert out.output_token_ids == [[2, 3, 4], [0], [5, 1]]
    assert out.num_accepted.tolist() == [2, 0, 1]
    # one logprobs row per output token, from the rows that scored them
    assert out.logprobs_tensors.token_ids[:, 0].tolist() == [2, 3, 4, 0, 5, 1]
    assert out.logprobs_tensors.ranks.tolist() == [1] * 6


def test_one_greedy_request_alone_as_in_a_batch():
    """A greedy request keeps the same drafts, bonus token and logprobs alone as beside another request."""
    g = torch.Generator().manual_seed(5)
    for num_logprobs in (None, 2):
        for drafts in ([], [1], [4, 4, 4], [0, 1, 2, 3]):
            logits = torch.randn(len(drafts) + 1, V, generator=g)
            target = logits.argmax(dim=-1).tolist()
            drafts = [target[i] if i < len(drafts) - 1 else d for i, d in enumerate(drafts)]  # last may miss
            other = torch.randn(3, V, generator=g)
            alone = rejection_sample(logits, make_metadata([{"temperature": 0.0}] * len(target), V,
                                                           max_num_logprobs=num_logprobs),
                                     np.array([len(drafts)]), np.array(drafts, dtype=np.int64))
            batched = rejection_sample(torch.cat([other, logits]),
                                       make_metadata([{"temperature": 0.0}] * (3 + len(target)), V,
                                                     max_num_logprobs=num_logprobs),
                                       np.array([2, len(drafts)]), np.array([0, 0] + drafts, dtype=np.int64))
            assert alone.output_token_ids == batched.output_token_ids[1:]
            assert alone.num_accepted.tolist() == batched.num_accepted[1:].tolist()
            if num_logprobs is None:
                assert alone.logprobs_tensors is None
            else:
                n = len(alone.output_token_ids[0])
                for f in ("token_ids", "logprobs", "ranks"):
                    assert torch.equal(getattr(alone.logprobs_tensors, f), getattr(batched.logprobs_tensors, f)[-n:])


def test_no_drafts_is_the_plain_sampler():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3))
    rows = [{"temperature": 0.0}, {"temperature": 0.7}, {"temperature": 1.0, "top_k": 3}, {"temperature": 0.0},
            {"temperature": 1.3, "top_p": 0.8}]
    def gens():
        return {i: seeded_generator(10, i) for i in range(5)}

    plain = Sampler()(logits, make_metadata(rows, V, gens()))
    out = rejection_sample(logits, make_metadata(rows, V, gens()), np.zeros(5, dtype=np.int64),
                           np.zeros(0, dtype=np.int64))
    assert out.output_token_ids == [[t] for t in plain.sampled_token_ids.tolist()]


def _dist(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 1.5


def test_random_rows_keep_the_target_distribution():
    """Two positions with different target distributions p0, p1 and drafts d0, d1 drawn at random per
    request: the first token is ~ p0, and the second (given the first was d0) is ~ p1."""
    n = 60_000
    l0, l1, l2 = _dist(1), _dist(2), _dist(3)
    logits = torch.stack([l0, l1, l2]).repeat(n, 1)  # request r's rows 3r..3r+2
    rng = np.random.default_rng(0)
    drafts = rng.integers(0, V, size=(n, 2))
    md = make_metadata([{"temperature": 0.9}] * (3 * n), V)
    out = rejection_sample(logits, md, np.full(n, 2), drafts.reshape(-1))
    first = np.array([o[0] for o in out.output_token_ids])
    p0 = torch.softmax(l0 / 0.9, -1).numpy()
    assert chi_square_pvalue(np.bincount(first, minlength=V), p0) > 1e-4
    kept = [o[1] for o, d in zip(out.output_token_ids, drafts) if o[0] == d[0]]
    p1 = torch.softmax(l1 / 0.9, -1).numpy()
    assert len(kept) > 5000
    assert chi_square_pvalue(np.bincount(np.array(kept), minlength=V), p1) > 1e-4
    # the draft is accepted with probability p0(d0)
    accept_rate = np.mean(out.num_accepted >= 1)
    assert abs(accept_rate - p0[drafts[:, 0]].mean()) < 0.01


def test_top_k_and_residual_never_pick_masked_tokens():
    n = 20_000
    logits = _dist(5).repeat(2 * n, 1)
    md = make_metadata([{"temperature": 1.0, "top_k": 2}] * (2 * n), V)
    allowed = set(torch.topk(_dist(5), 2).indices.tolist())
    drafts = np.random.default_rng(1).integers(0, V, size=n)
    out = rejection_sample(logits, md, np.ones(n, dtype=np.int64), drafts)
    assert {o[0] for o in out.output_token_ids} <= allowed
    # a draft outside the top-k is never kept
    assert not any(o[0] == d and d not in allowed for o, d in zip(out.output_token_ids, drafts))


def test_seeded_rows_keep_the_target_distribution_and_ignore_drafts():
    """Seeded rows: the token at each position is the plain sampler's for that (seed, position), with
    or without drafts, and over many seeds it follows the target distribution."""
    n = 20_000
    l0, l1 = _dist(7), _dist(8)
    logits = torch.stack([l0, l1]).repeat(n, 1)
    md = make_metadata([{"temperature": 1.0}] * (2 * n), V,
                       {2 * r + i: seeded_generator(r, i) for r in range(n) for i in range(2)})
    drafts = np.random.default_rng(2).integers(0, V, size=n)
    out = rejection_sample(logits, md, np.ones(n, dtype=np.int64), drafts)
    alone = Sampler()(l0.repeat(n, 1), make_metadata([{"temperature": 1.0}] * n, V,
                                                     {r: seeded_generator(r, 0) for r in range(n)}))
    first = np.array([o[0] for o in out.output_token_ids])
    assert np.array_equal(first, alone.sampled_token_ids.numpy())
    assert chi_square_pvalue(np.bincount(first, minlength=V), torch.softmax(l0, -1).numpy()) > 1e-4
    kept = np.array([o[1] for o, d in zip(out.output_token_ids, drafts) if o[0] == d])
    assert len(kept) > 2000
    assert chi_square_pvalue(np.bincount(kept, minlength=V), torch.softmax(l1, -1).numpy()) > 1e-4

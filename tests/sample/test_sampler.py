"""Sampler tests on fixed logits, against small reference implementations written in plain Python.

No model is loaded. Sampling distributions are checked with a chi-square test at a fixed seed
(p-value from the regularised upper incomplete gamma function, so scipy is not needed); every
deterministic stage (filters, penalties, logits processors, logprobs) is compared element-wise.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from tests.sample.reference import (V, chi_square_pvalue, fixed_logits, make_metadata, padded, reference_penalties,
                                    reference_probs, reference_processors, row_logits)
from vlite.sample import sampler as sampler_mod
from vlite.sample.sampler import (Sampler, apply_logits_processors, apply_min_p, apply_penalties,
                                  apply_top_k_top_p, gather_logprobs, random_sample, seeded_generator)
from vlite.sampling_params import SamplingParams

NUM_SAMPLES = 20_000  # draws per row
ALPHA = 1e-4  # chi-square rejection level (the seed is fixed, so this only sets the margin)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: intra-op threads only add overhead (and contention on a shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sample_many(logits: torch.Tensor, rows: list[dict], n: int = NUM_SAMPLES) -> np.ndarray:
    """Draw n samples per row in one batched Sampler call; returns [rows, V] counts."""
    b, v = logits.shape
    big = logits.repeat_interleave(n, dim=0)
    md = make_metadata([r for r in rows for _ in range(n)], v)
    out = Sampler()(big, md)
    assert out.logprobs_tensors is None
    ids = out.sampled_token_ids.view(b, n).numpy()
    return np.stack([np.bincount(ids[i], minlength=v) for i in range(b)])


# ---- 1. distributions ---------------------------------------------------------------------------

DIST_ROWS = [
    {"temperature": 1.0},  # plain softmax
    {"temperature": 0.6},  # temperature alone, sharper
    {"temperature": 1.7},  # temperature alone, flatter
    {"top_k": 5},
    {"top_p": 0.8},
    {"min_p": 0.08},
    {"temperature": 2.5, "min_p": 0.15},  # min_p sees the tempered distribution
    {"temperature": 1.5, "top_k": 8, "top_p": 0.85},
    {"temperature": 0.8, "min_p": 0.03, "top_p": 0.7},
]


def test_filters_equal_reference_distribution():
    """temperature -> apply_min_p -> apply_top_k_top_p gives exactly the reference distribution."""
    logits = fixed_logits(len(DIST_ROWS), seed=1)
    md = make_metadata(DIST_ROWS, V)
    x = logits / md.temperature[:, None]
    x = apply_min_p(x, md.min_p)
    x = apply_top_k_top_p(x, md.top_k, md.top_p)
    probs = torch.softmax(x, dim=-1).double()
    for i, r in enumerate(DIST_ROWS):
        ref = torch.tensor(reference_probs(row_logits(logits, i), **r), dtype=torch.float64)
        assert torch.equal(probs[i] > 0, ref > 0), (r, probs[i], ref)
        torch.testing.assert_close(probs[i], ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 19, 20, 50])
def test_top_k_edges(k):
    logits = fixed_logits(3, seed=2)
    rows = [{"top_k": k}, {}, {"top_k": 3}]
    md = make_metadata(rows, V)
    x = apply_top_k_top_p(logits.clone(), md.top_k, None)
    for i, r in enumerate(rows):
        ref = reference_probs(row_logits(logits, i), **r)
        assert [v > -math.inf for v in x[i].tolist()] == [p > 0 for p in ref]
        kept = x[i] > -math.inf
        assert torch.equal(x[i][kept], logits[i][kept])  # kept logits untouched


@pytest.mark.parametrize("p", [1e-6, 0.3, 0.5, 0.95, 0.997])
def test_top_p_edges(p):
    """The most likely token always survives; p = 1 rows next to top-p rows are untouched."""
    logits = fixed_logits(3, seed=3)
    rows = [{"top_p": p}, {}, {"top_p": 0.6}]
    md = make_metadata(rows, V)
    x = apply_top_k_top_p(logits.clone(), None, md.top_p)
    assert bool((x[1] == logits[1]).all())
    for i, r in enumerate(rows):
        ref = reference_probs(row_logits(logits, i), **r)
        assert [v > -math.inf for v in x[i].tolist()] == [q > 0 for q in ref], (r, x[i], ref)
    assert int((x[0] > -math.inf).sum()) >= 1
    assert x[0].argmax() == logits[0].argmax()


def test_top_p_tiny_keeps_exactly_the_top_token():
    """float32 cumulative sums can end below 1 - p: the most likely token must still survive."""
    logits = fixed_logits(64, 1000, seed=9)
    md = make_metadata([{"top_p": 1e-7}] * 64, 1000)
    x = apply_top_k_top_p(logits.clone(), None, md.top_p)
    assert torch.equal((x > -math.inf).sum(dim=-1), torch.ones(64, dtype=torch.int64))
    assert torch.equal(x.argmax(dim=-1), logits.argmax(dim=-1))
    torch.manual_seed(0)
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(dim=-1))


def test_sampled_frequencies_match_reference():
    logits = fixed_logits(len(DIST_ROWS), seed=1)
    torch.manual_seed(1234)
    counts = sample_many(logits, DIST_ROWS)
    for i, r in enumerate(DIST_ROWS):
        ref = np.array(reference_probs(row_logits(logits, i), **r))
        p = chi_square_pvalue(counts[i], ref)
        assert p > ALPHA, (r, p, counts[i], np.round(ref * NUM_SAMPLES))


def test_chi_square_detects_wrong_distribution():
    """The statistic has power: samples of one row do not fit a neighbouring row's distribution."""
    logits = fixed_logits(1, seed=1)
    torch.manual_seed(99)
    counts = sample_many(logits, [{"temperature": 1.0}])[0]
    wrong = np.array(reference_probs(row_logits(logits, 0), temperature=1.1))
    assert chi_square_pvalue(counts, wrong) < ALPHA


def test_mixed_greedy_and_random_rows():
    rows = [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 6}, {"temperature": 0.0},
            {"temperature": 0.9, "top_p": 0.75}, {"temperature": 0.0}]
    logits = fixed_logits(len(rows), seed=4)
    logits[4, 7] = logits[4].max() + 1e-3  # a near-tie the argmax must still resolve exactly
    torch.manual_seed(7)
    n = 8000
    counts = sample_many(logits, rows, n=n)
    for i, r in enumerate(rows):
        if r["temperature"] == 0.0:
            assert counts[i, int(logits[i].argmax())] == n
        else:
            ref = np.array(reference_probs(row_logits(logits, i), **r))
            assert chi_square_pvalue(counts[i], ref) > ALPHA


def test_greedy_rows_ignore_filters_and_take_processed_argmax():
    """A greedy row next to filtered random rows: argmax of the processed logits, never NaN."""
    logits = fixed_logits(2, seed=5)
    md = make_metadata([{"temperature": 0.0}, {"temperature": 0.5, "top_k": 2, "min_p": 0.2}], V)
    target = int(logits[0].argmin())
    md.logit_bias = (torch.tensor([0]), torch.tensor([target]), torch.tensor([100.0]))
    for _ in range(20):
        out = Sampler()(logits, md).sampled_token_ids
        assert int(out[0]) == target
        assert int(out[1]) in logits[1].topk(2).indices.tolist()


def seeded_draws(logits_row: torch.Tensor, position: int, batch: int, seed: int, steps: int,
                 other_seed: int, extra_rows: list[dict]) -> list[int]:
    """Sample a seeded row at `position` of a batch of `batch` rows for `steps` steps."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(other_seed)
    draws = []
    for _ in range(steps):
        logits = torch.from_numpy(rng.standard_normal((batch, V)).astype(np.float32))
        logits[position] = logits_row
        rows = [extra_rows[j % len(extra_rows)] for j in range(batch)]
        rows[position] = {"temperature": 0.9, "top_p": 0.9}
        gens = {position: gen}
        if batch > 2:  # another seeded row in the batch, with its own generator
            other = (position + 1) % batch
            gens[other] = torch.Generator().manual_seed(other_seed)
        md = make_metadata(rows, V, generators=gens)
        draws.append(int(Sampler()(logits, md).sampled_token_ids[position]))
    return draws


def test_seeded_rows_independent_of_batch_and_reproducible():
    row = fixed_logits(1, seed=6)[0]
    steps = 60
    torch.manual_seed(0)
    base = seeded_draws(row, 0, 1, seed=42, steps=steps, other_seed=0, extra_rows=[{}])
    mixes = [
        (3, 5, 1, [{"temperature": 0.0}]),  # greedy companions
        (1, 4, 2, [{"top_k": 3}, {"temperature": 1.3}]),
        (6, 7, 3, [{"min_p": 0.1}, {"temperature": 0.0}, {}]),
    ]
    for position, batch, other_seed, extra in mixes:
        torch.manual_seed(other_seed + 100)  # the global generator differs too
        draws = seeded_draws(row, position, batch, seed=42, steps=steps, other_seed=other_seed, extra_rows=extra)
        assert draws == base, (position, batch)
    other = seeded_draws(row, 0, 1, seed=43, steps=steps, other_seed=0, extra_rows=[{}])
    assert other != base


def test_seeded_rows_do_not_touch_global_generator_and_follow_distribution():
    """With every row seeded, each row draws only from its own generator; the draws fit the reference."""
    rows = [{"temperature": 0.9, "top_p": 0.9}, {"top_k": 4}]
    logits = fixed_logits(len(rows), seed=6)
    n = 4000
    big = logits.repeat_interleave(n, dim=0)
    gens = {i: torch.Generator().manual_seed(1000 + i) for i in range(len(rows) * n)}
    md = make_metadata([r for r in rows for _ in range(n)], V, generators=gens)
    state = torch.get_rng_state()
    ids = Sampler.sample(big, md).view(len(rows), n).numpy()
    assert torch.equal(torch.get_rng_state(), state)
    for i, r in enumerate(rows):
        ref = np.array(reference_probs(row_logits(logits, i), **r))
        counts = np.bincount(ids[i], minlength=V)
        assert chi_square_pvalue(counts, ref) > ALPHA, (r, counts)
    # Same seeds, same draws; each generator advanced by exactly one row of draws.
    again = {i: torch.Generator().manual_seed(1000 + i) for i in range(len(rows) * n)}
    md2 = make_metadata([r for r in rows for _ in range(n)], V, generators=again)
    assert np.array_equal(Sampler.sample(big, md2).view(len(rows), n).numpy(), ids)
    probe = torch.Generator().manual_seed(1000)
    torch.rand(1, generator=probe)
    assert torch.equal(gens[0].get_state(), probe.get_state())


def test_random_sample_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]]).repeat(20_000, 1)
    torch.manual_seed(11)
    ids = random_sample(probs.clone(), {})
    counts = np.bincount(ids.numpy(), minlength=6)
    assert chi_square_pvalue(counts, probs[0].double().numpy()) > ALPHA



@pytest.mark.parametrize("vocab", [40_000, 50_257, 128_256])  # a block size dividing it, none, 1,002
def test_two_level_inverse_cdf_is_the_cumulative_sum_lookup(vocab):
    """Large vocabularies sample in two levels (block sums, then within the block): where every cumulative sum is
    exact in float32 (dyadic probabilities), the same token as one float64 cumulative sum's lookup for every u,
    zero-probability tokens and blocks skipped; the first and last tokens and both sides of block edges reachable."""
    assert sampler_mod.cdf_block(vocab) > 0
    bs = sampler_mod.cdf_block(vocab)
    live = [0, 5, bs - 1, bs, 3 * bs + 7, vocab - 2, vocab - 1]
    probs = torch.zeros(1, vocab)
    probs[0, live] = torch.tensor([2.0 ** -k for k in range(1, len(live))] + [2.0 ** -(len(live) - 1)])
    us = torch.linspace(0, 1, 2001)[:-1]
    got = sampler_mod.inverse_cdf_sample(probs.repeat(len(us), 1), us)
    cdf = probs[0].double().cumsum(0)
    want = torch.searchsorted(cdf, us.double() * cdf[-1], right=True)
    assert torch.equal(got, want)
    assert set(got.tolist()) == set(live)


def test_two_level_inverse_cdf_samples_the_distribution():
    probs = torch.zeros(50_000)
    probs[[3, 1023, 1024, 25_000, 49_999]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    torch.manual_seed(12)
    ids = random_sample(probs.repeat(20_000, 1), {})
    counts = np.bincount(ids.numpy(), minlength=50_000)
    assert counts.sum() == counts[probs.numpy() > 0].sum()
    assert chi_square_pvalue(counts[probs.numpy() > 0], probs[probs > 0].double().numpy()) > ALPHA

# ---- 2. penalties and logits processors ---------------------------------------------------------

PV = 50  # vocabulary of the penalty tests


def random_token_lists(rng: random.Random, num_rows: int, vocab: int) -> tuple[list, list]:
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(num_rows)]
    outputs = [[rng.randrange(vocab // 2) for _ in range(rng.randint(0, 15))] for _ in range(num_rows)]
    outputs[0] = []  # a row with no output yet
    return prompts, outputs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_reference(seed):
    rng = random.Random(seed)
    b = 6
    logits = fixed_logits(b, PV, seed=seed + 10, scale=3.0)
    prompts, outputs = random_token_lists(rng, b, PV)
    rep = [1.0, 1.3, 0.7, 1.0, 2.0, 1.1]
    freq = [0.0, 0.5, -0.4, 1.5, 0.0, 0.2]
    pres = [0.0, 0.3, 0.0, -1.0, 1.2, 0.7]
    md = make_metadata([{}] * b, PV)
    md.repetition_penalties = torch.tensor(rep)
    md.frequency_penalties = torch.tensor(freq)
    md.presence_penalties = torch.tensor(pres)
    md.prompt_token_ids = padded(prompts, PV)
    md.output_token_ids = padded(outputs, PV)
    got = apply_penalties(logits.clone(), md)
    for i in range(b):
        ref = reference_penalties(row_logits(logits, i), prompts[i], outputs[i], rep[i], freq[i], pres[i])
        torch.testing.assert_close(got[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("which", ["repetition", "frequency", "presence"])
def test_each_penalty_alone(which):
    rng = random.Random(5)
    b = 4
    logits = fixed_logits(b, PV, seed=20, scale=3.0)
    prompts, outputs = random_token_lists(rng, b, PV)
    values = [1.0, 1.5, 0.5, 1.8] if which == "repetition" else [0.0, 1.5, -0.5, 1.8]
    md = make_metadata([{}] * b, PV)
    setattr(md, f"{which}_penalties", torch.tensor(values))
    md.prompt_token_ids = padded(prompts, PV)
    md.output_token_ids = padded(outputs, PV)
    got = apply_penalties(logits.clone(), md)
    for i in range(b):
        kw = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0, which: values[i]}
        ref = reference_penalties(row_logits(logits, i), prompts[i], outputs[i], **kw)
        torch.testing.assert_close(got[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=1e-6)


def test_no_penalties_is_identity():
    logits = fixed_logits(3, PV, seed=21)
    md = make_metadata([{}] * 3, PV)
    assert md.no_penalties
    assert torch.equal(apply_penalties(logits.clone(), md), logits)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_logits_processors_match_reference(seed):
    rng = random.Random(seed)
    b = 6
    logits = fixed_logits(b, PV, seed=seed + 30)
    _, outputs = random_token_lists(rng, b, PV)
    allowed = {1: rng.sample(range(PV), 7), 4: rng.sample(range(PV), 1)}
    bias = {0: {3: 5.0, 7: -2.5}, 2: {rng.randrange(PV): 10.0}, 4: {allowed[4][0]: -3.0, 9: 4.0}}
    suppress = {2: [0, 1], 5: [rng.randrange(PV)]}
    bad_words: dict[int, list[list[int]]] = {}
    for i in (0, 3, 5):
        words = [[rng.randrange(PV)]]  # a single-token word: always banned
        out = outputs[i]
        if len(out) >= 2:
            words.append(out[-2:] + [rng.randrange(PV)])  # prefix matches the output's tail
            words.append([out[-1], (out[-2] + 1) % PV, rng.randrange(PV)])  # prefix does not match
        words.append([rng.randrange(PV) for _ in range(len(out) + 2)])  # longer than the output
        bad_words[i] = words
    md = make_metadata([{}] * b, PV)
    mask = torch.zeros(b, PV, dtype=torch.bool)
    for r, ids in allowed.items():
        mask[r] = True
        mask[r, ids] = False
    md.disallowed_mask = mask
    md.logit_bias = (torch.tensor([r for r, d in bias.items() for _ in d]),
                     torch.tensor([t for d in bias.values() for t in d]),
                     torch.tensor([v for d in bias.values() for v in d.values()]))
    md.min_tokens = (torch.tensor([r for r, ids in suppress.items() for _ in ids]),
                     torch.tensor([t for ids in suppress.values() for t in ids]))
    md.bad_words_token_ids = bad_words
    md.output_token_lists = {i: outputs[i] for i in bad_words}
    got = apply_logits_processors(logits.clone(), md)
    for i in range(b):
        ref = reference_processors(row_logits(logits, i), outputs[i], allowed.get(i), bad_words.get(i),
                                   suppress.get(i), bias.get(i))
        torch.testing.assert_close(got[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=1e-6)


def test_bad_words_cases():
    logits = torch.zeros(1, 10)
    cases = [
        ([], [[4]], {4}),  # single token, no output yet
        ([1, 2], [[5]], {5}),
        ([1, 2], [[2, 6]], {6}),  # prefix [2] ends the output
        ([1, 2], [[1, 6]], set()),  # [1] is not the tail
        ([1, 2], [[1, 2, 7]], {7}),
        ([2], [[1, 2, 7]], set()),  # output shorter than the prefix
        ([], [[1, 7]], set()),
        ([3, 3, 3], [[3, 3, 8], [3, 9], [2, 3, 1]], {8, 9}),
    ]
    for output, words, banned in cases:
        md = make_metadata([{}], 10)
        md.bad_words_token_ids = {0: words}
        md.output_token_lists = {0: output}
        got = apply_logits_processors(logits.clone(), md)[0]
        assert {i for i in range(10) if got[i] == -math.inf} == banned, (output, words)


def test_sampler_does_not_modify_input_logits():
    logits = fixed_logits(2, PV, seed=40)
    before = logits.clone()
    md = make_metadata([{"temperature": 0.7, "top_k": 5}, {"temperature": 0.0}], PV, max_num_logprobs=3)
    md.logit_bias = (torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([1.0, -1.0]))
    md.disallowed_mask = torch.zeros(2, PV, dtype=torch.bool)
    md.disallowed_mask[1, :10] = True
    Sampler()(logits, md)
    assert torch.equal(logits, before)


# ---- 3. logprobs --------------------------------------------------------------------------------


def reference_rank(row: list[float], token: int) -> int:
    return 1 + sum(1 for x in row if x > row[token])


@pytest.mark.parametrize("num_logprobs", [0, 1, 5, 32])
def test_gather_logprobs_topk_and_ranks_with_ties(num_logprobs):
    g = torch.Generator().manual_seed(8)
    b, v = 16, 32
    logits = torch.randint(-3, 3, (b, v), generator=g).float()  # many exact ties
    logprobs = torch.log_softmax(logits, dim=-1)
    token_ids = torch.randint(0, v, (b,), generator=g)
    token_ids[0] = int(logprobs[0].argmax())  # rank 1
    token_ids[1] = int(logprobs[1].argmin())
    lt = gather_logprobs(logprobs, num_logprobs, token_ids)
    assert lt.token_ids.shape == lt.logprobs.shape == (b, num_logprobs + 1)
    assert torch.equal(lt.token_ids[:, 0], token_ids)
    assert torch.equal(lt.logprobs[:, 0], logprobs[torch.arange(b), token_ids])
    if num_logprobs:
        top_lp, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
        assert torch.equal(lt.logprobs[:, 1:], top_lp)
        assert torch.equal(lt.token_ids[:, 1:], top_ids)
        assert torch.equal(logprobs.gather(1, lt.token_ids[:, 1:]), lt.logprobs[:, 1:])
        assert bool((lt.logprobs[:, 1:].diff(dim=-1) <= 0).all())
    for i in range(b):
        assert int(lt.ranks[i]) == reference_rank(logprobs[i].tolist(), int(token_ids[i]))
    assert int(lt.ranks[0]) == 1
    # Every token tied with the top one has rank 1.
    tied = (logprobs[2] == logprobs[2].max()).nonzero()[:, 0]
    ranks = gather_logprobs(logprobs[2:3].expand(len(tied), v), 0, tied).ranks
    assert ranks.tolist() == [1] * len(tied)


def test_sampler_logprobs_come_from_raw_logits():
    b, v = 4, 24
    logits = fixed_logits(b, v, seed=60).to(torch.bfloat16)
    md = make_metadata([{"temperature": 0.3, "top_k": 3}, {"temperature": 0.0}, {"min_p": 0.2},
                        {"temperature": 2.0, "top_p": 0.5}], v, max_num_logprobs=4)
    md.logit_bias = (torch.tensor([1]), torch.tensor([int(logits[1].float().argmin())]), torch.tensor([50.0]))
    md.repetition_penalties = torch.tensor([1.0, 1.0, 3.0, 1.0])
    md.prompt_token_ids = padded([[0], [0], [int(logits[2].float().argmax())], [0]], v)
    md.output_token_ids = padded([[], [], [], []], v)
    torch.manual_seed(3)
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits.float(), dim=-1)
    lt = out.logprobs_tensors
    assert lt.logprobs.dtype == torch.float32
    top_lp, top_ids = torch.topk(raw, 4, dim=-1)
    torch.testing.assert_close(lt.logprobs[:, 1:], top_lp)
    assert torch.equal(lt.token_ids[:, 1:], top_ids)
    assert torch.equal(lt.token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lt.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    for i in range(b):
        assert int(lt.ranks[i]) == reference_rank(raw[i].tolist(), int(out.sampled_token_ids[i]))
    # The greedy row took the biased token, whose raw rank is the last one.
    assert int(out.sampled_token_ids[1]) == int(logits[1].float().argmin())
    assert int(lt.ranks[1]) == reference_rank(raw[1].tolist(), int(logits[1].float().argmin())) > 1


def test_no_logprobs_requested():
    md = make_metadata([{}], V)
    assert Sampler()(fixed_logits(1), md).logprobs_tensors is None
    md.max_num_logprobs = 0
    lt = Sampler()(fixed_logits(1), md).logprobs_tensors
    assert lt.token_ids.shape == (1, 1)


# ---- 4. greedy fast path ------------------------------------------------------------------------


def test_all_greedy_batch_skips_random_sampling(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("random path taken for an all-greedy batch")

    monkeypatch.setattr(sampler_mod, "random_sample", forbidden)
    monkeypatch.setattr(sampler_mod, "apply_top_k_top_p", forbidden)
    monkeypatch.setattr(sampler_mod, "apply_min_p", forbidden)
    logits = fixed_logits(6, seed=70)
    logits[3, 4] = logits[3].max()  # exact tie: the first maximal index wins
    gen = torch.Generator().manual_seed(1)
    md = make_metadata([{"temperature": 0.0}] * 6, V, generators={2: gen})
    assert md.all_greedy and md.temperature is None
    rng_state, gen_state = torch.get_rng_state(), gen.get_state()
    for _ in range(3):
        out = Sampler()(logits, md)
        assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
        assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert torch.equal(gen.get_state(), gen_state)

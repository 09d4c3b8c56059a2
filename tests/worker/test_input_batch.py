"""InputBatch: the SamplingMetadata it builds for the rows a step samples (the columns of the rows'
sampling parameters, the padded token lists of penalties, the sparse processors) against the plain-Python
references of tests/sample/reference.py, and when it is reused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.sample.reference import fixed_logits, padded, reference_penalties, reference_processors, row_logits
from vlite.sample.sampler import Sampler, apply_logits_processors, apply_penalties, seeded_generator
from vlite.sampling_params import SamplingParams
from vlite.worker.input_batch import InputBatch

RV = 40  # vocabulary of these tests
EOS = 2


def make_batch(max_num_reqs: int = 8) -> InputBatch:
    return InputBatch(max_num_reqs, max_model_len=64, max_blocks_per_req=4, vocab_size=RV, eos_token_ids=[EOS])


def test_reuses_metadata_only_while_the_rows_are_unchanged():
    batch = make_batch()
    add(batch, "a", [5, 6], [7], SamplingParams(temperature=0.7, top_k=5))
    add(batch, "b", [5], [8], SamplingParams(temperature=0.0))
    rows = np.array([0, 1])
    md = batch.make_sampling_metadata(rows)
    assert batch.make_sampling_metadata(rows) is md  # a decode step with the same batch
    assert batch.make_sampling_metadata(np.array([0])) is not md  # other rows
    add(batch, "c", [5], [9], SamplingParams(temperature=1.0, top_p=0.5))
    md3 = batch.make_sampling_metadata(np.array([0, 1, 2]))
    assert md3.top_p is not None and torch.equal(md3.top_p, torch.tensor([1.0, 1.0, 0.5]))
    batch.remove_request("c")
    add(batch, "d", [5], [9], SamplingParams(temperature=1.0))  # row 2 again, other params
    md4 = batch.make_sampling_metadata(np.array([0, 1, 2]))
    assert md4 is not md3 and md4.top_p is None
    # What changes every step (penalties' token lists, min_tokens) is never reused.
    add(batch, "e", [5], [9], SamplingParams(temperature=1.0, repetition_penalty=1.2, min_tokens=3))
    rows = np.array([0, 1, 2, 3])
    assert batch.make_sampling_metadata(rows) is not batch.make_sampling_metadata(rows)


def add(batch: InputBatch, req_id: str, prompt: list[int], output: list[int], params: SamplingParams) -> int:
    return batch.add_request(req_id, prompt + output, len(prompt), len(prompt) + len(output) - 1, [0], params)


def row_reference(logits_row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    suppress = []
    if len(output) < p.min_tokens:
        suppress = list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])
    x = reference_processors(logits_row, output, p.allowed_token_ids, p._bad_words_token_ids, suppress,
                             p.logit_bias)
    return reference_penalties(x, prompt, output, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)


def test_metadata_matches_reference():
    batch = make_batch()

    def params(**kw) -> SamplingParams:
        bad = kw.pop("bad", None)
        p = SamplingParams(max_tokens=32, **kw)
        if bad:
            p.bad_words = ["x"] * len(bad)
            p._bad_words_token_ids = bad
        return p

    reqs = {
        "a": ([5, 6, 7, 8], [9, 10, 9], params(temperature=0.0, repetition_penalty=1.3, logprobs=2)),
        "gone": ([1], [], params()),
        "b": ([11] * 9, [], params(temperature=0.8, top_k=5, frequency_penalty=0.5, min_tokens=2,
                                   stop_token_ids=[3, 4], logit_bias={12: 3.0, 13: -1.0})),
        "c": ([1, 2, 3], [20, 21, 22, 20, 21], params(top_p=0.9, presence_penalty=-0.7, seed=7,
                                                       bad=[[21, 22], [20, 21, 23], [24], [22, 25]])),
        "d": ([30, 31], [32], params(min_p=0.1, allowed_token_ids=[1, 2, 3, 32, 33], min_tokens=3,
                                     ignore_eos=True, stop_token_ids=[3], logprobs=-1)),
        "e": ([4, 4, 5], [EOS, 6], params(temperature=1.2, top_k=-1, min_tokens=2, stop_token_ids=[7])),
    }
    for req_id, (prompt, output, p) in reqs.items():
        add(batch, req_id, prompt, output, p)
    batch.remove_request("gone")  # leaves a hole at row 1
    order = ["e", "a", "c", "d", "b"]  # an arbitrary order of rows
    rows = np.array([batch.req_id_to_index[r] for r in order], dtype=np.int64)
    md = batch.make_sampling_metadata(rows)

    ps = [reqs[r][2] for r in order]
    assert md.all_greedy is False and md.all_random is False
    assert md.temperature.tolist() == pytest.approx([p.temperature for p in ps])
    assert md.top_k.tolist() == [p.top_k if p.top_k > 0 else RV for p in ps]
    assert md.top_p.tolist() == pytest.approx([p.top_p for p in ps])
    assert md.min_p.tolist() == pytest.approx([p.min_p for p in ps])
    assert md.max_num_logprobs == RV
    # The seeded request's generator is keyed by its seed and the position of the token to sample.
    assert set(md.generators) == {order.index("c")}
    expected = seeded_generator(7, len(reqs["c"][1])).get_state()
    assert torch.equal(md.generators[order.index("c")].get_state(), expected)

    # Padded prompt/output ids, as the penalty kernels expect them.
    prompts = [reqs[r][0] for r in order]
    outputs = [reqs[r][1] for r in order]
    assert torch.equal(md.prompt_token_ids, padded(prompts, RV))
    assert torch.equal(md.output_token_ids, padded(outputs, RV))

    logits = fixed_logits(len(order), RV, seed=50, scale=3.0)
    got = apply_penalties(apply_logits_processors(logits.clone(), md), md)
    for i, r in enumerate(order):
        prompt, output, p = reqs[r]
        ref = row_reference(row_logits(logits, i), prompt, output, p)
        torch.testing.assert_close(got[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=1e-6,
                                   msg=lambda m: f"request {r}: {m}")

    # The whole sampler on this metadata: the greedy row takes the processed argmax, no row
    # samples a token its processors forbid, logprobs come from the raw logits.
    out = Sampler()(logits, md)
    ids = out.sampled_token_ids.tolist()
    assert ids[order.index("a")] == int(torch.tensor(row_reference(row_logits(logits, 1), *reqs["a"])).argmax())
    for i, r in enumerate(order):
        assert got[i, ids[i]] > -math.inf
    assert ids[order.index("d")] in [1, 2, 32, 33]
    lt = out.logprobs_tensors
    assert lt.token_ids.shape == (len(order), RV + 1)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lt.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])


def test_metadata_fast_paths_and_padding():
    batch = make_batch()
    add(batch, "g1", [1, 2, 3], [4], SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3))
    add(batch, "g2", [5], [], SamplingParams(temperature=0.0))
    rows = np.array([0, 1])
    md = batch.make_sampling_metadata(rows)
    assert md.all_greedy and not md.all_random and md.temperature is None
    # Greedy params are normalised, so no filter stage is built.
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.no_penalties and md.prompt_token_ids is None and md.output_token_ids is None
    assert md.disallowed_mask is None and md.logit_bias is None and md.min_tokens is None
    assert md.max_num_logprobs is None and not md.bad_words_token_ids

    add(batch, "r", [7, 8, 9, 10], [], SamplingParams(temperature=1.0, presence_penalty=0.1))
    md = batch.make_sampling_metadata(np.array([0, 1, 2]))
    assert md.all_random is False and md.all_greedy is False
    assert torch.equal(md.prompt_token_ids, padded([[1, 2, 3], [5], [7, 8, 9, 10]], RV))
    assert torch.equal(md.output_token_ids, padded([[4], [], []], RV))
    md = batch.make_sampling_metadata(np.array([2]))
    assert md.all_random
    assert md.output_token_ids.shape == (1, 1) and int(md.output_token_ids[0, 0]) == RV


def test_min_tokens_threshold_and_bad_words_use_outputs_only():
    batch = make_batch()
    p = SamplingParams(min_tokens=2, stop_token_ids=[5], max_tokens=10)
    p_bad = SamplingParams(max_tokens=10)
    p_bad.bad_words = ["w"]
    p_bad._bad_words_token_ids = [[8, 9]]
    add(batch, "m", [1, 1], [], p)
    add(batch, "w", [3, 8], [], p_bad)  # the prompt ends with 8, but only outputs count
    b = batch
    rows = np.array([0, 1])

    def banned(md, i):
        x = apply_logits_processors(torch.zeros(2, RV), md)[i]
        return {t for t in range(RV) if x[t] == -math.inf}

    md = batch.make_sampling_metadata(rows)
    assert banned(md, 0) == {5, EOS} and banned(md, 1) == set()
    for token, expect_m, expect_w in [(8, {5, EOS}, {9}), (4, set(), set())]:
        # Simulate sample_tokens appending one token to each row.
        b.token_ids[rows, b.num_tokens[rows]] = token
        b.num_tokens[rows] += 1
        md = batch.make_sampling_metadata(rows)
        assert banned(md, 0) == expect_m, token
        assert banned(md, 1) == expect_w, token

"""Thinking budgets (SamplingParams.thinking_token_budget, --reasoning-budget): the sampler's forcing of one
token on the budgeted rows only, the tracker's count (multi-token end tags, drafts), and on the tiny thinking
model: at most B thinking tokens then the end tag, greedy and seeded random (n = 2), under a JSON schema on
the answer, and with n-gram speculative decoding (the same tokens as without)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.reasoning import thinking_model as tm
from tests.reasoning.test_reasoning_offline import SCHEMA, make_llm
from vlite import SamplingParams
from vlite.reasoning import PENDING, REASONING
from vlite.reasoning.tracker import ReasoningTracker
from vlite.sample.metadata import SamplingMetadata, with_forced_tokens
from vlite.sample.sampler import Sampler, process_logits
from vlite.sampling_params import StructuredOutputsParams

PIECES = ["\nPonder", tm.DECOY, " deeply."]  # the greedy thinking of the generation prompt
QWEN3_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<｜User｜>Weather in Paris?" + tm.R1_OPEN  # the prompt opens the block


def metadata(rows: int, greedy: bool, **kwargs) -> SamplingMetadata:
    return SamplingMetadata(temperature=None if greedy else torch.ones(rows), all_greedy=greedy,
                            all_random=not greedy, top_p=None, top_k=None, min_p=None, generators={},
                            max_num_logprobs=None, **kwargs)


@pytest.mark.parametrize("greedy", [True, False])
def test_sampler_forces_the_budgeted_rows_only(greedy) -> None:
    logits = torch.randn(4, 50)
    bias = (torch.tensor([1, 1]), torch.tensor([7, 8]), torch.tensor([100.0, 50.0]))  # row 1 prefers 7
    md = metadata(4, greedy, logit_bias=bias, forced_tokens=(torch.tensor([1, 3]), torch.tensor([5, 9])))
    _, processed = process_logits(logits.clone(), md)
    for row, token in ((1, 5), (3, 9)):
        assert torch.isfinite(processed[row]).nonzero().flatten().tolist() == [token]
    assert torch.equal(processed[[0, 2]], logits[[0, 2]])  # the other rows untouched
    for _ in range(5):
        assert Sampler()(logits.clone(), md).sampled_token_ids[[1, 3]].tolist() == [5, 9]


def test_forced_rows_follow_the_drafts() -> None:
    md = metadata(6, True)
    out = with_forced_tokens(md, ["a", "b", "c"], np.array([2, 0, 1]), {"a": 9, "c": 4}, torch.device("cpu"))
    rows, ids = out.forced_tokens
    assert rows.tolist() == [2, 5] and ids.tolist() == [9, 4]  # each request's row after its drafts
    assert md.forced_tokens is None and with_forced_tokens(md, ["a"], None, {}, torch.device("cpu")) is md


def test_tracker_counts_and_forces_a_multi_token_end_tag() -> None:
    start, end = (1,), (8, 9)
    t = ReasoningTracker(start, end, implicit_start=False, phase=PENDING)
    assert t.forced_token(0) is None  # the output may not think at all
    t.accept(1)
    assert t.in_reasoning and t.forced_token(0) == 8 and t.forced_token(1) is None
    for token in (5, 6):
        t.accept(token)
    assert t.forced_token(2) == 8 and t.forced_token(3) is None
    t.accept(8)  # the model began the end tag on its own: its rest is forced
    assert t.forced_token(3) == 9 and t.forced_token(5) is None
    # Drafts stop short of the forced position; the state after drafts forces the row that follows them.
    t = ReasoningTracker(start, end, False, REASONING)
    assert t.drafts_within_budget([5, 6, 7], 2) == [5, 6] and t.forced_token(2, [5, 6]) == 8
    assert t.drafts_within_budget([5, 8, 9, 4], 5) == [5, 8, 9, 4]  # the block closes inside the drafts
    # R1: the output is reasoning from its first token; a budget of 0 closes it at once.
    assert ReasoningTracker(start, end, implicit_start=True, phase=PENDING).forced_token(0) == 8


def test_budget_validation() -> None:
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="thinking_token_budget must be"):
            SamplingParams(thinking_token_budget=bad)
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0


def thinking(llm, token_ids: list[int], opened: bool = False) -> tuple[int, bool]:
    """(tokens between the start and end tags, whether the end tag came) of an output."""
    tok = llm.get_tokenizer()
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    first = 0 if opened else token_ids.index(start) + 1
    if end in token_ids:
        return token_ids.index(end) - first, True
    return len(token_ids) - first, False


@pytest.fixture(scope="module")
def llm(thinking_model_dir):
    return make_llm(thinking_model_dir, reasoning_parser="qwen3")


def test_greedy_budgets(llm) -> None:
    budgets = [0, 1, 2, 3, 10, None]
    params = [SamplingParams(temperature=0.0, max_tokens=40, thinking_token_budget=b) for b in budgets]
    outs = llm.generate([QWEN3_PROMPT] * len(budgets), params, use_tqdm=False)  # one batch, mixed budgets
    for b, out in zip(budgets, outs):
        kept = PIECES if b is None else PIECES[:b]
        assert out.outputs[0].text == "<think>" + "".join(kept) + "</think>" + tm.ANSWER, b


@pytest.fixture(scope="module")
def r1(thinking_model_dir):
    return make_llm(thinking_model_dir, reasoning_parser="deepseek_r1")


@pytest.mark.parametrize("budget", [0, 2, 5])
def test_random_sampling_n2(r1, budget) -> None:
    """R1's prompt opens the block; each child (its own count) thinks at most B tokens, then the end tag."""
    for kwargs in ({"seed": 7}, {"top_k": 20, "top_p": 0.9}, {"seed": 3, "logit_bias": {5: 5.0}}):
        # At temperature 60 the model's chains are lost in the noise: the thinking runs on until forced.
        params = SamplingParams(temperature=60.0, max_tokens=12, n=2, thinking_token_budget=budget, **kwargs)
        children = r1.generate([R1_PROMPT], params, use_tqdm=False)[0].outputs
        assert len(children) == 2 and children[0].token_ids != children[1].token_ids
        for c in children:
            n, closed = thinking(r1, list(c.token_ids), opened=True)
            assert n <= budget and (closed or c.finish_reason == "stop"), (kwargs, c.token_ids)
            if "seed" in kwargs:  # these draws are fixed: no early end tag or EOS among them
                assert n == budget and closed


def test_json_schema_after_the_budget(llm) -> None:
    pytest.importorskip("xgrammar")
    so = StructuredOutputsParams(json=SCHEMA)
    for b in (0, 1):
        out = llm.generate([QWEN3_PROMPT], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so,
                                                          thinking_token_budget=b), use_tqdm=False)[0].outputs[0]
        reasoning, tag, answer = out.text.removeprefix("<think>").partition("</think>")
        assert tag and reasoning == "".join(PIECES[:b])
        assert json.loads(answer) == [{"name": "get_weather", "parameters": {"city": "Paris"}}]


def test_spec_decode_drafts_stop_at_the_forced_token(thinking_model_dir) -> None:
    """The prompt holds the whole chain, so n-gram drafts run through the thinking and past its end: the
    budget cuts them, and the tokens are those of plain decoding."""
    prompt = "<|im_start|>user\n<think>" + "".join(PIECES) + "</think>" + tm.ANSWER + "<|im_end|>\n" \
        "<|im_start|>assistant\n"
    spec = make_llm(thinking_model_dir, reasoning_parser="qwen3", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
        "draft_policy": "always"})
    for b in (0, 1, 2):
        params = SamplingParams(temperature=0.0, max_tokens=30, thinking_token_budget=b)
        text = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        assert text == "<think>" + "".join(PIECES[:b]) + "</think>" + tm.ANSWER, b
        # Random (the rejection sampler's random path), the prompt opening the block: the forced row holds.
        random = SamplingParams(temperature=60.0, seed=b, max_tokens=12, thinking_token_budget=b)
        ids = list(spec.generate([prompt + "<think>"], random, use_tqdm=False)[0].outputs[0].token_ids)
        assert thinking(spec, ids, opened=True) == (b, True), ids
    assert spec.llm_engine.engine_core.scheduler.spec_decoding_stats.num_accepted_tokens > 0  # drafts ran


def test_needs_a_reasoning_parser_and_server_default(thinking_model_dir) -> None:
    plain = make_llm(thinking_model_dir)
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning parser"):
        plain.generate([QWEN3_PROMPT], SamplingParams(thinking_token_budget=1), use_tqdm=False)
    del plain
    with pytest.raises(ValueError, match="reasoning_budget needs reasoning_parser"):
        make_llm(thinking_model_dir, reasoning_budget=2)
    with pytest.raises(ValueError, match="reasoning_budget must be"):
        make_llm(thinking_model_dir, reasoning_parser="qwen3", reasoning_budget=-2)
    default = make_llm(thinking_model_dir, reasoning_parser="qwen3", reasoning_budget=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    outs = default.generate([QWEN3_PROMPT] * 2, [greedy, SamplingParams(temperature=0.0, max_tokens=40,
                                                                        thinking_token_budget=2)], use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["<think>" + "".join(PIECES[:b]) + "</think>" + tm.ANSWER
                                                 for b in (1, 2)]
    assert greedy.thinking_token_budget is None  # the caller's params are left as they were

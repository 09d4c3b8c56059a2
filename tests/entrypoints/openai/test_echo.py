"""`echo` on /v1/completions, as lm-evaluation-harness scores with it (echo + logprobs + max_tokens=0),
through the official openai client against the shared float32 server on the real default model."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.e2e.prompts import prompts_of_lengths
from tests.e2e.reference import ATOL

pytestmark = pytest.mark.slow

TEXTS = ["Question: What is the capital of France?\nAnswer: Paris", "The quick brown fox jumps", "a"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["id"]


def tokenize(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=server.headers).json()["tokens"]


def check_shape(lp, text: str, n_prompt: int, n_top: int) -> None:
    """OpenAI's legacy logprobs object over an echoed choice: the prompt's tokens first (the first one
    without logprobs), each token's text where text_offset says, top_logprobs of n_top (+ the token)."""
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) >= n_prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert n_top <= len(top) <= n_top + 1 and max(top.values()) >= chosen - 1e-6


def test_echo_puts_the_prompt_and_its_logprobs_before_the_generated_text(client, model):
    prompt = TEXTS[0]
    kwargs = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    plain = client.completions.create(**kwargs)
    echoed = client.completions.create(echo=True, **kwargs)
    c, ref = echoed.choices[0], plain.choices[0]
    assert c.text == prompt + ref.text and c.finish_reason == ref.finish_reason
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens > 0
    n_prompt = echoed.usage.prompt_tokens
    check_shape(c.logprobs, c.text, n_prompt, 2)
    assert c.logprobs.text_offset[n_prompt] == len(prompt)  # the generated text starts after the prompt
    assert c.logprobs.tokens[n_prompt:] == ref.logprobs.tokens
    assert c.logprobs.token_logprobs[n_prompt:] == pytest.approx(ref.logprobs.token_logprobs, abs=1e-4)
    # Without logprobs: the text alone.
    text_only = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert text_only.choices[0].text == c.text and text_only.choices[0].logprobs is None


def test_max_tokens_zero_scores_several_prompts_without_generating(server, client, model):
    scored = client.completions.create(model=model, prompt=TEXTS, max_tokens=0, echo=True, logprobs=1)
    ids = [tokenize(server, t) for t in TEXTS]
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == sum(map(len, ids))
    choices = sorted(scored.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2]
    for c, text, p in zip(choices, TEXTS, ids):
        assert c.text == text and c.finish_reason == "length"
        assert len(c.logprobs.tokens) == len(p)
        check_shape(c.logprobs, text, len(p), 1)
    # The same prompts as token ids: the prompt's text decoded, the same logprobs.
    by_ids = sorted(client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=1).choices,
                    key=lambda c: c.index)
    for a, b in zip(choices, by_ids):
        assert b.text == a.text and b.logprobs.tokens == a.logprobs.tokens
        assert b.logprobs.token_logprobs[1:] == pytest.approx(a.logprobs.token_logprobs[1:], abs=1e-4)
    # No logprobs asked: just the prompts.
    bare = client.completions.create(model=model, prompt=TEXTS[:2], max_tokens=0, echo=True)
    assert sorted(c.text for c in bare.choices) == sorted(TEXTS[:2]) and bare.usage.completion_tokens == 0
    assert all(c.logprobs is None and c.finish_reason == "length" for c in bare.choices)
    # Nothing was left running or holding KV blocks.
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, m


def test_max_tokens_zero_needs_echo(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    err = e.value.body
    err = err.get("error", err)
    assert err["param"] == "max_tokens" and "echo" in err["message"], err


def test_echo_streamed(server, client, model):
    kwargs = dict(model=model, prompt=TEXTS[1], max_tokens=5, temperature=0, logprobs=2, echo=True)
    full = client.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].choices[0].text.startswith(TEXTS[1])  # the prompt comes with the first chunk
    assert "".join(c.choices[0].text for c in chunks) == full.text
    for key in ("tokens", "text_offset"):
        assert sum((getattr(c.choices[0].logprobs, key) for c in chunks), []) == getattr(full.logprobs, key)
    assert chunks[-1].choices[0].finish_reason == full.finish_reason
    # max_tokens=0: one chunk, the prompt, finished.
    zero = [c for c in client.completions.create(stream=True, **{**kwargs, "max_tokens": 0}) if c.choices]
    assert len(zero) == 1 and zero[0].choices[0].text == TEXTS[1] and zero[0].choices[0].finish_reason == "length"
    n_prompt = len(tokenize(server, TEXTS[1]))
    assert zero[0].choices[0].logprobs.tokens == full.logprobs.tokens[:n_prompt]


@torch.inference_mode()
def test_prompt_logprobs_match_transformers(client, model, hf_model, hf_tokenizer):
    """echo + logprobs + max_tokens=0 (float32 server, dense weights) against transformers' float32 forward."""
    prompts = prompts_of_lengths(hf_tokenizer, [7, 40, 150])
    out = client.completions.create(model=model, prompt=prompts, max_tokens=0, echo=True, logprobs=5)
    worst = 0.0
    for c in out.choices:
        ids = prompts[c.index]
        rows = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        lp = c.logprobs
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        for j in range(1, len(ids)):
            ref = rows[j - 1]
            worst = max(worst, abs(lp.token_logprobs[j] - float(ref[ids[j]])))
            assert abs(lp.token_logprobs[j] - float(ref[ids[j]])) < ATOL, (c.index, j)
            # The top 5 and the token itself (keyed by text, so two tokens of one text may share a key).
            expected = torch.topk(ref, 5).values.tolist() + [float(ref[ids[j]])]
            top = lp.top_logprobs[j].values()
            assert abs(max(top) - expected[0]) < ATOL
            assert all(min(abs(v - e) for e in expected) < ATOL for v in top), (c.index, j)
    print(f"largest prompt-logprob difference from transformers: {worst:.2e}")

"""Prefix caching and preemption on the real model: same tokens, fewer computed tokens, no leak."""

from __future__ import annotations

import pytest

from tests.e2e.reference import ATOL, compare_greedy, compare_runs
from vlite import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)


def _run(llm: LLM, prompts):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]


def _check(outputs, references):
    return [compare_greedy(o.token_ids, o.logprobs, ref, ATOL)["matched"] for o, ref in zip(outputs, references)]


def _assert_no_leak(llm: LLM):
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"] and m["kv_cache_usage_perc"] == 0.0


def test_prefix_caching_on_off_same_tokens(shared_prefix_prompts, shared_prefix_references):
    on = LLM(dtype="float32", max_num_batched_tokens=64)
    first = _run(on, shared_prefix_prompts)
    hits_first = on.get_metrics()["prefix_cache_hits"]
    second = _run(on, shared_prefix_prompts)  # everything but each prompt's last block is cached now
    m = on.get_metrics()
    assert hits_first > 0, "prompts sharing a 300-token prefix should hit within one generate()"
    assert m["prefix_cache_hits"] - hits_first >= sum((len(p) - 1) // 16 * 16 for p in shared_prefix_prompts)
    _assert_no_leak(on)
    off = LLM(dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=False)
    third = _run(off, shared_prefix_prompts)
    assert off.get_metrics()["prefix_cache_hits"] == 0
    for outs in (first, second, third):
        print(_check(outs, shared_prefix_references))
    for a, b in zip(first, third):
        compare_runs(a, b)


def test_preemption_keeps_outputs(prompts, references):
    # 64 blocks of 16 tokens: far less than the 8 prompts (1..600 tokens) + 64 outputs each need.
    from vlite.model_loader import resolve_model  # noqa: F401  (the model is the default one)

    bytes_per_block = 2 * 30 * 16 * 3 * 64 * 4
    llm = LLM(dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=64 * bytes_per_block)
    assert llm.get_metrics()["num_kv_blocks"] == 64
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    m = llm.get_metrics()
    print(f"preemptions: {m['num_preemptions']}")
    assert m["num_preemptions"] >= 3
    for out, ref in zip(outputs, references):
        compare_greedy(out.outputs[0].token_ids, out.outputs[0].logprobs, ref, ATOL)
    _assert_no_leak(llm)


def test_shared_prefix_computed_once(hf_tokenizer):
    from tests.e2e.prompts import corpus_ids

    ids = corpus_ids(hf_tokenizer)
    prefix = ids[5000:5512]
    prompts = [prefix + ids[9000 + 31 * i:9000 + 31 * i + 8] for i in range(8)]
    llm = LLM(dtype="float32")
    m0 = llm.get_metrics()
    cached = _run(llm, prompts)
    m = llm.get_metrics()
    hits = m["prefix_cache_hits"] - m0["prefix_cache_hits"]
    queries = m["prefix_cache_queries"] - m0["prefix_cache_queries"]
    assert hits == 7 * 512, f"the 512-token prefix should be computed once, got {hits} cached tokens"
    assert queries - hits == 512 + 8 * 8  # tokens actually computed for the prompts
    _assert_no_leak(llm)
    uncached = _run(LLM(dtype="float32", enable_prefix_caching=False), prompts)
    for a, b in zip(cached, uncached):
        compare_runs(a, b)

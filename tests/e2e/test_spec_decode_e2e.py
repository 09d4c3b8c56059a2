"""Speculative decoding on the real model (float32): greedy outputs token-identical to decoding
without it, in mixed batches with chunked prefills, with processors, stops, preemption and
structured outputs; seeded sampling independent of the batch."""

from __future__ import annotations

import pytest

from vlite import LLM, SamplingParams

pytestmark = pytest.mark.slow

# "always": drafts whenever there is a match, beside requests without (the adaptive default would run few
# verify steps in these small tests)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "draft_policy": "always", "max_num_batched_draft_tokens": 64}
ENGINE = dict(dtype="float32", max_num_batched_tokens=128, kv_cache_memory_bytes=128 * 2**20)


@pytest.fixture(scope="module")
def llm_spec():
    return LLM(speculative_config=SPEC, **ENGINE)


def _tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def _assert_no_leak(llm: LLM) -> None:
    m = llm.llm_engine.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_greedy_identical_mixed_batch_chunked_prefill(llm_spec, llm_fp32, prompts):
    """Eight prompts of 1-600 tokens (Python sources: much to look up) in one generate, prefilled in
    128-token chunks beside other requests' decodes and verify steps."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1)
    batch = [{"prompt_token_ids": p} for p in prompts]
    ref = llm_fp32.generate(batch, params, use_tqdm=False)
    before = llm_spec.llm_engine.engine_core.make_stats().spec_decoding.num_accepted_tokens
    out = llm_spec.generate(batch, params, use_tqdm=False)
    assert _tokens(out) == _tokens(ref)
    for a, b in zip(out, ref):  # logprobs of every token, also the accepted drafts
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [list(x) for x in la] == [list(x) for x in lb]
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-3 for x, y in zip(la, lb) for t in x)
    stats = llm_spec.llm_engine.engine_core.make_stats().spec_decoding
    assert stats.num_accepted_tokens - before > 50  # speculation did happen
    _assert_no_leak(llm_spec)


def test_greedy_identical_with_processors_stops_and_n(llm_spec, llm_fp32, hf_tokenizer):
    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
             "one two three four five one two three four five one two three",
             "The list: apple, banana, cherry, apple, banana, cherry, apple,"]
    banana = hf_tokenizer.encode(" banana")
    cases = [
        SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.3, frequency_penalty=0.2,
                       presence_penalty=0.3, min_tokens=24, logit_bias={banana[0]: -2.0}),
        SamplingParams(temperature=0.0, max_tokens=32, bad_words=[" four five"], stop=["cherry, apple"],
                       stop_token_ids=[hf_tokenizer.encode(":")[0]], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=7, n=2),
    ]
    for params in cases:
        ref = llm_fp32.generate(texts, params, use_tqdm=False)
        out = llm_spec.generate(texts, params, use_tqdm=False)
        assert _tokens(out) == _tokens(ref), params
        assert [c.text for o in out for c in o.outputs] == [c.text for o in ref for c in o.outputs]
        assert [c.finish_reason for o in out for c in o.outputs] == [c.finish_reason for o in ref for c in o.outputs]
    _assert_no_leak(llm_spec)


def test_structured_output_identical(llm_spec, llm_fp32):
    pytest.importorskip("xgrammar")
    from vlite.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items":
              {"type": "string"}}}, "required": ["name", "tags"]}
    prompt = 'Output JSON. {"name": "box", "tags": ["red", "blue", "red", "blue"]} and again:'
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    ref = llm_fp32.generate([prompt], params, use_tqdm=False)
    out = llm_spec.generate([prompt], params, use_tqdm=False)
    assert _tokens(out) == _tokens(ref)


@pytest.mark.parametrize("engine", [{}, {"dtype": "float32", "quantization": "int8"}], ids=["default", "float32-int8"])
def test_greedy_identical_on_the_quantized_kernels(engine):
    """The engine as users run it, the C++ kernels on quantized weights, where int8 rounding of the
    activations magnifies any difference in a row's arithmetic: logprobs equal to the bit with and
    without speculation. Prompts of 4-9 tokens (chunks as short as a verify step stay prefills), a
    prefix-cache hit leaving a few prompt tokens, verify steps of 9 rows (past the float32 residual
    row's limit of 8: the rows go by the step's rows less its drafts)."""
    texts = ["Hello there, my", "Say 1 2 3", "one two three four five one two three four five one two three",
             "Repeat exactly: The quick brown fox jumps over the lazy dog near the river bank.\nRepeat:"]
    kwargs = dict(engine, max_num_batched_tokens=128, kv_cache_memory_bytes=64 * 2**20)
    spec = dict(SPEC, num_speculative_tokens=8)
    base, llm = LLM(**kwargs), LLM(speculative_config=spec, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    before = llm.llm_engine.engine_core.make_stats().spec_decoding.num_accepted_tokens
    for batch in ([texts[3]], texts):  # the second time texts[3] hits the prefix cache
        ref, out = base.generate(batch, params, use_tqdm=False), llm.generate(batch, params, use_tqdm=False)
        assert _tokens(out) == _tokens(ref)
        for a, b in zip(out, ref):
            assert [{t: x.logprob for t, x in p.items()} for p in a.outputs[0].logprobs] == \
                [{t: x.logprob for t, x in p.items()} for p in b.outputs[0].logprobs]
    assert llm.llm_engine.engine_core.make_stats().spec_decoding.num_accepted_tokens - before > 20
    _assert_no_leak(llm)


def test_preemption_identical(prompts):
    """A KV cache of 24 blocks (384 tokens) for 4 requests of 12-260 + 48 tokens: requests are preempted and
    recomputed, their drafts dropped and proposed again."""
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, 16 tokens, 3 KV heads of 64, float32
    engine = dict(ENGINE, kv_cache_memory_bytes=24 * block_bytes)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts[2:6]]
    base = LLM(**engine)
    ref = base.generate(batch, params, use_tqdm=False)
    spec = LLM(speculative_config=SPEC, **engine)
    out = spec.generate(batch, params, use_tqdm=False)
    assert _tokens(out) == _tokens(ref)
    assert spec.llm_engine.engine_core.make_stats().num_preemptions > 0
    _assert_no_leak(spec)


def test_default_dtype_identical_in_any_chunking_and_with_speculation(prompts):
    """bf16 (the default for the GGUF): int8 activations turn last-bit differences into other tokens, so
    the prompt's attention must be the same bits however the prompt was chunked: by the step budget,
    the batch beside it, or the drafts taking part of the budget (SDPA's were not). Greedy requests, and
    seeded sampled ones (their tokens depend on nothing but their logits)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    params = [greedy if i % 2 else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(len(prompts))]
    batch = [{"prompt_token_ids": p} for p in prompts]
    whole = LLM(max_num_batched_tokens=1024)
    alone = [_tokens(whole.generate([b], p, use_tqdm=False))[0] for b, p in zip(batch, params)]
    assert _tokens(whole.generate(batch, params, use_tqdm=False)) == alone
    del whole
    chunked = LLM(max_num_batched_tokens=48)
    assert _tokens(chunked.generate(batch, params, use_tqdm=False)) == alone
    del chunked
    spec = LLM(max_num_batched_tokens=48, speculative_config=SPEC)
    assert _tokens(spec.generate(batch, params, use_tqdm=False)) == alone
    assert spec.llm_engine.engine_core.make_stats().spec_decoding.num_accepted_tokens > 20
    _assert_no_leak(spec)


def test_seeded_sampling_independent_of_batch(llm_spec, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=1234)
    others = SamplingParams(temperature=1.0, max_tokens=30)
    target = {"prompt_token_ids": prompts[4]}
    alone = llm_spec.generate([target], seeded, use_tqdm=False)
    crowd = llm_spec.generate([{"prompt_token_ids": p} for p in prompts[:4]] + [target],
                              [others] * 4 + [seeded], use_tqdm=False)
    assert _tokens(alone)[0] == _tokens(crowd)[-1]


def test_verify_steps_reuse_sampling_metadata_without_per_row_fields(llm_spec, monkeypatch):
    """A greedy request without processors: one SamplingMetadata serves its prompt step and its verify
    steps, whose logits rows repeat the request (it was rebuilt at each verify step, ~0.1 ms)."""
    batch = llm_spec.llm_engine.engine_core.executor.model_runner.input_batch
    built, asked = [], []
    build, make = batch._build_sampling_metadata, batch.make_sampling_metadata
    monkeypatch.setattr(batch, "_build_sampling_metadata",
                        lambda rows, offsets=None: built.append(len(rows)) or build(rows, offsets))
    monkeypatch.setattr(batch, "make_sampling_metadata",
                        lambda rows, offsets=None: asked.append(len(rows)) or make(rows, offsets))
    text = "one two three four five one two three four five one two three four five one two"
    ref = llm_spec.generate(text, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert any(n > 1 for n in asked)  # verify steps ...
    assert built == [1]  # ... served by the metadata built for the first step
    # a request with a per-row field (a temperature) beside it gets metadata of its own rows
    built.clear()
    out = llm_spec.generate([text, text], [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                           SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True)],
                            use_tqdm=False)
    assert _tokens(out)[0] == _tokens(ref)[0] and len(built) > 1
    _assert_no_leak(llm_spec)

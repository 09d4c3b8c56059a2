"""LLMEngine on the real model: streaming, aborts, bad input rejected before any work."""

from __future__ import annotations

import pytest

from vlite import LLM, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a haiku about the sea.",
    "List three emoji that mean happiness: ",
    "Translate to Japanese: good morning, my friend.",
    "The quick brown fox",
]


def _drain(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _assert_all_blocks_free(llm: LLM) -> None:
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"], m
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0


def test_streamed_deltas_join_to_final_text(llm_fp32):
    engine = llm_fp32.llm_engine
    tok = engine.get_tokenizer()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"delta-{i}", prompt, SamplingParams(temperature=0, max_tokens=48,
                                                                output_kind=RequestOutputKind.DELTA))
        engine.add_request(f"cumul-{i}", prompt, SamplingParams(temperature=0, max_tokens=48))
    outputs = _drain(engine)
    for i in range(len(PROMPTS)):
        deltas = outputs[f"delta-{i}"]
        cumulative = outputs[f"cumul-{i}"]
        assert deltas[-1].finished and cumulative[-1].finished
        assert sum(1 for o in deltas if o.finished) == 1
        text = "".join(o.outputs[0].text for o in deltas)
        token_ids = [t for o in deltas for t in o.outputs[0].token_ids]
        final = cumulative[-1].outputs[0]
        assert token_ids == final.token_ids
        assert text == final.text
        assert "\ufffd" not in text
        assert text == tok.decode(final.token_ids, skip_special_tokens=True)
        # Cumulative outputs only ever grow.
        texts = [o.outputs[0].text for o in cumulative]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    _assert_all_blocks_free(llm_fp32)


def test_abort_frees_blocks_and_reports_abort(llm_fp32):
    engine = llm_fp32.llm_engine
    for i in range(6):
        engine.add_request(f"ab-{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0, max_tokens=40,
                                                                                ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(["ab-0", "ab-2", "ab-4", "no-such-request"])
    outputs = _drain(engine)
    for i in range(6):
        final = outputs[f"ab-{i}"][-1]
        assert final.finished
        if i % 2 == 0:
            assert final.outputs[0].finish_reason == "abort"
        else:
            assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 40
    engine.abort_request("ab-1")  # finished already: a no-op
    _assert_all_blocks_free(llm_fp32)


def test_stop_token_ids_and_eos(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    out = llm_fp32.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert len(ids) >= 3
    stop_id = ids[2]
    stopped = llm_fp32.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=30,
                                                                      stop_token_ids=[stop_id]), use_tqdm=False)[0]
    first = ids.index(stop_id)
    assert stopped.outputs[0].token_ids == ids[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_id
    chat = llm_fp32.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200),
                         use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == tok.eos_token_id
    assert chat.stop_reason is None and chat.text and "<|im_end|>" not in chat.text


@pytest.mark.parametrize("params,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
])
def test_invalid_sampling_params(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


def test_bad_prompts_rejected_before_any_work(llm_fp32):
    engine = llm_fp32.llm_engine
    max_len = engine.max_model_len
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="prompt"):
        llm_fp32.generate("", ok, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm_fp32.generate({"prompt_token_ids": [1] * (max_len + 1)}, ok, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm_fp32.generate({"prompt_token_ids": [5, 10**6]}, ok, use_tqdm=False)
    # One bad prompt in a batch: nothing starts.
    before = llm_fp32.get_metrics()["prompt_tokens"]
    with pytest.raises(ValueError, match="prompt"):
        llm_fp32.generate(["fine", "also fine", ""], ok, use_tqdm=False)
    assert llm_fp32.get_metrics()["prompt_tokens"] == before
    assert not engine.has_unfinished_requests()
    _assert_all_blocks_free(llm_fp32)


def test_prompt_beyond_kv_pool_rejected():
    small = LLM(dtype="float32", kv_cache_memory_bytes=2 * 2**20, block_size=16)
    cap = small.llm_engine.input_processor.kv_capacity_tokens
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        small.generate({"prompt_token_ids": [1] * (cap + 1)}, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(dtype="float32", kv_cache_memory_bytes=2 * 2**20, max_model_len=4096)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent/dir/model.gguf")

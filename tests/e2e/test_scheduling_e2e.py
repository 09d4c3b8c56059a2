"""Scheduling policies and aborts on the real model: order changes, results do not."""

from __future__ import annotations

import random

import pytest

from tests.e2e.reference import compare_runs
from vlite import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_priority_same_tokens_as_fcfs(prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    batch = [{"prompt_token_ids": p} for p in prompts]
    fcfs = LLM(dtype="float32", max_num_seqs=2, max_num_batched_tokens=128)
    a = fcfs.generate(batch, params, use_tqdm=False)
    prio = LLM(dtype="float32", max_num_seqs=2, max_num_batched_tokens=128, scheduling_policy="priority")
    priorities = [5, 1, 7, 0, 3, 3, 9, 2]
    b = prio.generate(batch, params, use_tqdm=False, priority=priorities)
    assert [o.prompt_token_ids for o in b] == prompts
    for x, y in zip(a, b):
        compare_runs(x.outputs[0], y.outputs[0])


def test_abort_half_of_32_running(llm_fp32):
    engine = llm_fp32.llm_engine
    rng = random.Random(0)
    tok = llm_fp32.get_tokenizer()
    words = tok.decode(list(range(1000, 1400))).split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    for i, text in enumerate(texts):
        engine.add_request(f"r{i}", text, params)
    for _ in range(100):  # until every prompt is in (the step budget chunks them)
        engine.step()
        if engine.get_metrics()["num_requests_running"] == 32 and engine.get_metrics()["num_requests_waiting"] == 0:
            break
    assert engine.get_metrics()["num_requests_running"] == 32
    engine.abort_request([f"r{i}" for i in range(0, 32, 2)])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert len(finals) == 32
    m = engine.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    survivors = [f"r{i}" for i in range(1, 32, 2)]
    alone = llm_fp32.generate([texts[i] for i in range(1, 32, 2)], params, use_tqdm=False)
    for req_id, ref in zip(survivors, alone):
        out = finals[req_id].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 48
        compare_runs(out, ref.outputs[0])
    for i in range(0, 32, 2):
        assert finals[f"r{i}"].outputs[0].finish_reason == "abort"

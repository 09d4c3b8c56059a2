"""A request whose processing raises inside the engine fails alone, on the real model.

VLITE_FAULT_INJECT_TOKEN_ID makes the model runner raise in any step that computes that token.
One prompt carries it deep inside (its fault comes in a later prefill chunk, while the others are
decoding); the other prompts must still produce transformers' greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.e2e.reference import ATOL, compare_greedy
from vlite import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_poisoned_request_fails_alone(monkeypatch, prompts, references):
    used = {t for p in prompts for t in p} | {t for r in references for t in r.token_ids}
    poison = max(t for t in range(49152) if t not in used)
    monkeypatch.setenv("VLITE_FAULT_INJECT_TOKEN_ID", str(poison))
    llm = LLM(dtype="float32", max_num_batched_tokens=64)
    bad = prompts[5][:150] + [poison] + prompts[5][150:200]
    batch = prompts[:4] + [bad] + prompts[4:]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert outputs[4].outputs[0].finish_reason == "error"
    good = outputs[:4] + outputs[5:]
    for out, ref in zip(good, references):
        assert out.outputs[0].finish_reason == "length"
        compare_greedy(out.outputs[0].token_ids, out.outputs[0].logprobs, ref, ATOL)
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"] and m["num_preemptions"] == 0
    # The engine keeps serving, batched again.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
    for out, ref in zip(again, references):
        compare_greedy(out.outputs[0].token_ids, out.outputs[0].logprobs, ref, ATOL)

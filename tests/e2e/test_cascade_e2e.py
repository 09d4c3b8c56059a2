"""Cascade attention on the real model: requests sharing a 300-token prompt prefix attend it once per step
(the runner's cost model turns it on for their decode steps) and generate, in float32, the same greedy
tokens as with cascading off."""

from __future__ import annotations

import pytest

from tests.e2e.prompts import corpus_ids
from vlite import LLM, SamplingParams
from vlite.attention.backends import torch_sdpa
from vlite.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow


def test_cascade_same_greedy_tokens(hf_tokenizer, monkeypatch):
    ids = corpus_ids(hf_tokenizer)
    prefix = ids[1000:1300]
    prompts = [prefix + ids[3000 + 50 * i:3000 + 50 * i + 3 + 4 * i] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lengths = []
    original = ModelRunner._cascade_prefix_len

    def recorded(self, *args):
        length = original(self, *args)
        lengths.append(length)
        return length

    monkeypatch.setattr(ModelRunner, "_cascade_prefix_len", recorded)
    llm = LLM(dtype="float32")
    on = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                       use_tqdm=False)]
    # each decode step of the 16 requests (48 query vectors per kv head) cascades 18 shared blocks (288 tokens)
    assert lengths.count(288) >= 20, lengths
    monkeypatch.setattr(torch_sdpa, "CASCADE_MIN_VECTORS", 1 << 30)
    lengths.clear()
    llm.reset_prefix_cache()
    off = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    assert not any(lengths)
    assert on == off
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]

"""Mistral with a sliding window on every layer: float32 greedy output token-identical to transformers
on prompts longer than the window (chunked prefill mixed with decodes); and a generation many times
longer than the window keeps only the window's KV blocks allocated while it runs (the KV cache
manager frees the rest), still token-identical to transformers, and its freed-but-cached prefix
serves a later request correctly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.models import tiny

WINDOW = 24


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return tiny.build(MistralConfig, MistralForCausalLM, seed=13, sliding_window=WINDOW, tie_word_embeddings=False,
                      rope_theta=1e4)


def test_hf_folder_matches_transformers(hf_model: Any, folder: Path, prompt_ids: list[list[int]]) -> None:
    refs = tiny.references(hf_model, prompt_ids)
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "LlamaForCausalLM"
    assert llm.llm_engine.engine_core.kv_cache_manager.sliding_window == WINDOW
    print(tiny.assert_parity(completions, refs))


def test_long_generation_holds_only_the_window(hf_model: Any, folder: Path, prompt_ids: list[list[int]]) -> None:
    """A 63-token prompt, 160 tokens generated one step at a time: after the prompt, the request holds
    the blocks of its last WINDOW positions (at most 5 of 8 tokens), not the 28 its tokens fill."""
    from vlite import LLM, SamplingParams
    from vlite.engine.llm_engine import LLMEngine

    block_size, max_new = 8, 160
    prompt = prompt_ids[3]
    ref = tiny.references(hf_model, [prompt], max_new)[0]
    bytes_per_block = 2 * 2 * block_size * 2 * 16 * 4  # K and V, 2 layers, tokens, 2 KV heads, head_dim 16, float32
    llm = LLM(model=str(folder), dtype="float32", block_size=block_size, max_num_batched_tokens=16,
              kv_cache_memory_bytes=256 * bytes_per_block)
    engine: LLMEngine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    total = llm.get_metrics()["num_kv_blocks"]
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=1)
    engine.add_request("long", {"prompt_token_ids": prompt}, params)
    most_held, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        request = engine.engine_core.scheduler.requests.get("long")
        if request is None:
            break
        held = [b for b in kv.get_block_ids("long") if b >= 0]
        assert total - llm.get_metrics()["num_free_kv_blocks"] == len(held)
        # a decode step's query at c - 1 read the positions (c - 1 - WINDOW, c - 1]: their blocks only
        c = request.num_computed_tokens
        if c > len(prompt):
            assert len(held) <= (WINDOW - 1) // block_size + 2, (c, held)
            most_held = max(most_held, len(held))
    assert most_held == (WINDOW - 1) // block_size + 2 and len(prompt) + max_new > 25 * block_size
    assert llm.get_metrics()["num_free_kv_blocks"] == total
    completion = out.outputs[0]
    report = tiny.compare_greedy(completion.token_ids, completion.logprobs, ref, tiny.ATOL)
    assert report["diverged_at"] is None or report["diverged_at"] > 4 * WINDOW, report  # a near-tie, far out
    print(report)

    # The same prompt again: its blocks were freed behind the window but stay cached; the hit takes
    # only those its first query reads, and the output is transformers' again.
    again = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=30,
                                                                       ignore_eos=True, logprobs=1),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // block_size * block_size
    first = tiny.Reference(ref.token_ids[:30], ref.logprobs[:30])
    assert tiny.compare_greedy(again.outputs[0].token_ids, again.outputs[0].logprobs, first, tiny.ATOL)[
        "diverged_at"] is None

"""Multi-LoRA end to end on a tiny Llama: one generate() mixing three peft adapters (more than max_loras, and more
than max_cpu_loras: adapters wait, are evicted and loaded again) with base-model requests, chunked prefills
beside decodes; float32 greedy outputs token-identical to transformers + peft, also under tensor parallelism;
the prefix cache is never shared across adapters. (A GGUF base: test_lora_default_model.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest

from tests.lora.peft_models import make_adapter
from tests.models import tiny

pytest.importorskip("peft")
ADAPTERS = {"all": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]),
            "qv_rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"]),
            "k_down": dict(r=3, lora_alpha=5, target_modules=["k_proj", "down_proj"])}
# prompt i runs under ASSIGNED[i] (None: the base model): three adapters, max_loras 2
ASSIGNED = ["all", None, "qv_rslora", "k_down", "all", None]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny.tiny_tokenizer()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    return tiny.prompts(tokenizer)


@pytest.fixture(scope="module")
def base() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return tiny.build(LlamaConfig, LlamaForCausalLM, seed=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("lora_e2e")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLITE_CACHE_DIR", str(folder / "cache"))
        yield folder


@pytest.fixture(scope="module")
def adapters(base: Any, model_dir: Path) -> dict[str, tuple[Any, Any]]:
    """name -> (LoRARequest, peft's model with the adapter)."""
    from vlite.lora.request import LoRARequest

    out = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        model = make_adapter(base, model_dir / name, seed=10 + i, **spec)
        out[name] = (LoRARequest(name, i + 1, str(model_dir / name)), model.get_base_model())
    return out


@pytest.fixture(scope="module")
def refs(base: Any, adapters: dict, prompt_ids: list[list[int]]) -> list[Any]:
    """transformers (+ peft) greedy for each prompt under its adapter."""
    from tests.e2e.reference import hf_greedy

    return [hf_greedy(adapters[name][1] if name else base, p, tiny.MAX_NEW) for p, name in zip(prompt_ids, ASSIGNED)]


def lora_requests(adapters: dict, names: list[Optional[str]]) -> list[Any]:
    return [adapters[n][0] if n else None for n in names]


def test_mixed_batch_matches_peft(base: Any, tokenizer: Any, model_dir: Path, adapters: dict,
                                  prompt_ids: list[list[int]], refs: list[Any]) -> None:
    from vlite import LLM, SamplingParams

    folder = tiny.save_hf(base, tokenizer, model_dir / "hf")
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=tiny.STEP_TOKENS, kv_cache_memory_bytes=16 * 2**20,
              enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=tiny.MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False,
                           lora_request=lora_requests(adapters, ASSIGNED))
    print(tiny.assert_parity([o.outputs[0] for o in outputs], refs))
    runner = llm.llm_engine.engine_core.model_runner
    assert len(runner.lora_manager.list_loras()) <= 2  # max_cpu_loras: the third was evicted, then loaded again
    # an adapter's prefix is never served to the base model or another adapter: the same prompts again, each
    # under another adapter, compute every token (and still match their references)
    shifted = ASSIGNED[1:] + ASSIGNED[:1]
    again = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False,
                         lora_request=lora_requests(adapters, shifted))
    for out, name, ref_name in zip(again, shifted, ASSIGNED):
        if name != ref_name:
            assert out.num_cached_tokens == 0, (name, ref_name)
    same = llm.generate([{"prompt_token_ids": prompt_ids[-2]}], params, use_tqdm=False,
                        lora_request=adapters["all"][0])  # the same adapter: its prefix is a hit
    assert same[0].num_cached_tokens > 0
    assert same[0].outputs[0].token_ids == outputs[-2].outputs[0].token_ids


def test_speculative_decoding_under_adapters_matches_peft(base: Any, tokenizer: Any, model_dir: Path, adapters: dict,
                                                         prompt_ids: list[list[int]], refs: list[Any]) -> None:
    """n-gram drafts verified under each request's adapter (the drafts' rows run in its slot): the same tokens."""
    from vlite import LLM, SamplingParams

    folder = model_dir / "hf"
    if not folder.exists():
        tiny.save_hf(base, tokenizer, folder)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=tiny.STEP_TOKENS, kv_cache_memory_bytes=16 * 2**20,
              enable_lora=True, max_loras=3, max_lora_rank=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "draft_policy": "always",
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    params = SamplingParams(temperature=0.0, max_tokens=tiny.MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False,
                           lora_request=lora_requests(adapters, ASSIGNED))
    print(tiny.assert_parity([o.outputs[0] for o in outputs], refs))
    assert llm.llm_engine.engine_core.make_stats().spec_decoding.num_drafts > 0


def test_tensor_parallel_adapters_match_peft(base: Any, tokenizer: Any, model_dir: Path, adapters: dict,
                                             prompt_ids: list[list[int]], refs: list[Any]) -> None:
    """TP=2 (worker processes): each rank holds its cut of every adapter (B's rows of q/k/v and gate/up, A's
    columns of o and down); the same greedy tokens as transformers + peft."""
    from vlite import LLM, SamplingParams

    folder = model_dir / "hf"
    if not folder.exists():
        tiny.save_hf(base, tokenizer, folder)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=tiny.STEP_TOKENS, kv_cache_memory_bytes=16 * 2**20,
              enable_lora=True, max_loras=3, max_lora_rank=8, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tiny.MAX_NEW, ignore_eos=True, logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False,
                               lora_request=lora_requests(adapters, ASSIGNED))
        print(tiny.assert_parity([o.outputs[0] for o in outputs], refs))
    finally:
        llm.llm_engine.engine_core.shutdown()

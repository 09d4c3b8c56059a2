"""Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers between gated full-attention layers, from Hugging
Face folders; float32 greedy output token-identical to transformers with prompt chunks that cut through the scan,
a batch of mixed lengths, preempted requests and prefix-cache hits that restore a saved state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.layers.gated_deltanet import GatedDeltaNet
from vlite.layers.moe import SharedExpertMoE
from vlite.model_loader import load_model_weights, resolve_model

LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, num_hidden_layers=4, head_dim=32)


def _build(kind: str, gguf: bool = False) -> Any:
    """The tiny model of `kind`; `gguf`: one llama.cpp converts (its qwen3next has no dense layers among the
    mixtures, so Qwen3-Next's mlp_only_layers is left out)."""
    import transformers as t

    if kind == "qwen35":
        return tiny.build(t.Qwen3_5TextConfig, t.Qwen3_5ForCausalLM, seed=21, **LINEAR)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if kind == "qwen35moe":
        return tiny.build(t.Qwen3_5MoeTextConfig, t.Qwen3_5MoeForCausalLM, seed=22, **LINEAR, **moe)
    return tiny.build(t.Qwen3NextConfig, t.Qwen3NextForCausalLM, seed=23, **LINEAR, **moe,
                      **({} if gguf else {"mlp_only_layers": [2]}))


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe", "qwen3next"])
def hf_model(request: pytest.FixtureRequest) -> Any:
    return _build(request.param)


@pytest.fixture(scope="module")
def folder(hf_model: Any, tokenizer: Any, model_dir: Path) -> Path:
    return tiny.save_hf(hf_model, tokenizer, model_dir / f"hf-{hf_model.config.model_type}")


def test_config_from_hf_folder(hf_model: Any, folder: Path) -> None:
    cfg, _ = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.linear_layers == (0, 1, 2) and cfg.attention_layers == (3,)
    assert cfg.attn_output_gate and cfg.norm_unit_offset and cfg.rotary_dim == 8
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_conv_dim) == (2, 4, 128)


def test_hf_folder_matches_transformers(hf_model: Any, folder: Path, prompt_ids: list[list[int]],
                                        refs: list[Any]) -> None:
    """All prompts at once in small steps: prompt chunks cut through the scan, decodes batched with prefills."""
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    model = llm.llm_engine.engine_core.model_runner.model
    assert [type(layer.linear_attn) for layer in model.layers[:3]] == [GatedDeltaNet] * 3
    if hf_model.config.model_type != "qwen3_5_text":
        assert any(isinstance(layer.mlp, SharedExpertMoE) for layer in model.layers)
    print(tiny.assert_parity(completions, refs))


def _generate_twice(folder: Path, prompt_ids: list[list[int]], refs: list[Any], **kwargs: Any) -> tuple[Any, list]:
    from vlite import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="float32", max_num_batched_tokens=tiny.STEP_TOKENS, block_size=16,
              max_num_seqs=len(prompt_ids), **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=tiny.MAX_NEW, ignore_eos=True, logprobs=5)
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        print(tiny.assert_parity([o.outputs[0] for o in outputs], refs))
    return llm.llm_engine.engine_core, outputs


def test_preempted_requests_match_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    """A KV pool too small for every request at once: requests are preempted (their state slots freed) and
    recomputed from their prompt, or from a saved state."""
    # 40 blocks of 16 tokens (8 KiB each: one attention layer) after the states' 6 + 4 slots of 16.9 KiB
    state_bytes = 10 * 3 * (128 * 3 + 4 * 16 * 16) * 4
    core, _ = _generate_twice(folder, prompt_ids, refs, kv_cache_memory_bytes=state_bytes + 40 * 8192,
                              max_model_len=400)
    kv = core.kv_cache_manager
    assert kv.num_blocks == 40 and core.scheduler.num_preemptions > 0
    assert kv.get_num_free_blocks() == 40 and not kv.state_manager.req_to_slot


def test_prefix_hits_restore_saved_states(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    """The same prompts again: each one of a block or more starts from its last block boundary (the state saved
    there by the first run, the attention layers' blocks up to it), and generates the same tokens."""
    core, outputs = _generate_twice(folder, prompt_ids, refs, kv_cache_memory_bytes=16 * 2**20)
    assert [o.num_cached_tokens for o in outputs] == [(len(p) - 1) // 16 * 16 for p in prompt_ids]


@pytest.mark.parametrize("kwargs,match", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "rejected draft"),
    (dict(enable_lora=True), "LoRA"),
])
def test_refused_features_name_why(folder: Path, kwargs: dict, match: str) -> None:
    from vlite import LLM

    with pytest.raises(ValueError, match=match):
        LLM(model=str(folder), dtype="float32", **kwargs)


def test_kv_cache_groups_and_bench_report(folder: Path) -> None:
    """One full-attention group and the recurrent-state group; what `vlite bench` prints of them."""
    from vlite import LLM
    from vlite.benchmarks.utils import hardware_report

    llm = LLM(model=str(folder), dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=4 * 2**20)
    groups = hardware_report(llm.llm_engine)["kv_cache_groups"]
    assert groups[0] == {"kind": "FullAttentionSpec", "layers": 1, "window": 0, "kv_bytes_per_token": 2 * 2 * 32 * 4}
    assert groups[1] == {"kind": "MambaSpec", "layers": 3, "state_bytes_per_request": 3 * (128 * 3 + 4 * 16 * 16) * 4,
                         "state_slots": 8, "cached_state_slots": 4}

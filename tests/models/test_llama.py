"""Llama with every optional part switched on (q/k/v/o and MLP biases, untied head), from a Hugging
Face folder and from a float32 GGUF file (llama.cpp's rotary row order for Q/K, biases included);
float32 greedy output token-identical to transformers. The real default model's parity is
tests/e2e/test_parity.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.models import tiny


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return tiny.build(LlamaConfig, LlamaForCausalLM, seed=1, tie_word_embeddings=False, attention_bias=True,
                      mlp_bias=True)


def test_hf_folder_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                        refs: list[Any]) -> None:
    folder = tiny.save_hf(hf_model, tokenizer, model_dir / "hf")
    llm, completions = tiny.run_vlite(folder, prompt_ids, block_size=4)
    assert tiny.model_class_name(llm) == "LlamaForCausalLM"
    cfg = llm.llm_engine.engine_core.model_runner.arch
    assert cfg.attention_bias and cfg.attention_out_bias and cfg.mlp_bias and not cfg.qk_norm
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "llama-f32.gguf", "llama", f16=False)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    cfg = llm.llm_engine.engine_core.model_runner.arch
    assert cfg.architecture == "llama" and cfg.attention_bias and cfg.attention_out_bias and cfg.mlp_bias
    print(tiny.assert_parity(completions, refs))

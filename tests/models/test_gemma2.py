"""Gemma 2: attention-logit and final-logit soft-capping, every other layer a sliding window (the
first one included), queries scaled by query_pre_attn_scalar ** -0.5 (not head_dim's), (1 + weight)
norms before and after attention and MLP, GELU-tanh, embeddings scaled by sqrt(hidden), tied head;
float32 greedy output token-identical to transformers on prompts longer than the window, chunked
prefill mixed with decodes.

The caps are small (scores and logits of these random weights would never reach Gemma's 50 and 30),
so that a missing or misplaced tanh changes the output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.models import tiny
from vlite.model_loader import ModelArchConfig


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return tiny.build(Gemma2Config, Gemma2ForCausalLM, seed=11, num_hidden_layers=2, head_dim=16,
                      query_pre_attn_scalar=40, sliding_window=20, attn_logit_softcapping=1.5,
                      final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh", rope_theta=1e4)


def test_hf_folder_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path,
                                        prompt_ids: list[list[int]]) -> None:
    refs = tiny.references(hf_model, prompt_ids)
    folder = tiny.save_hf(hf_model, tokenizer, model_dir / "hf")
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    cfg: ModelArchConfig = llm.llm_engine.engine_core.model_runner.arch
    assert tiny.model_class_name(llm) == "Gemma2ForCausalLM"
    assert cfg.layer_windows == (20, 0) and cfg.query_pre_attn_scalar == 40 and cfg.tie_word_embeddings
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.5, 4.0)
    print(tiny.assert_parity(completions, refs))

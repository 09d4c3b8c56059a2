"""OLMoE: pre-norm layers, q/k RMSNorm over the whole q and k projections, a mixture of experts (8, top 2,
not renormalized) on every layer; from a Hugging Face folder, float32 greedy output token-identical to
transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.layers.moe import SparseMoE
from vlite.model_loader import load_model_weights, resolve_model
from vlite.model_loader.hf_config import arch_from_hf_config


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return tiny.build(OlmoeConfig, OlmoeForCausalLM, seed=13, num_experts=8, num_experts_per_tok=2,
                      intermediate_size=32, norm_topk_prob=False, tie_word_embeddings=False,
                      pad_token_id=tiny.ALT_EOS_ID)


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "olmoe" and cfg.qk_norm and cfg.qk_norm_full and not cfg.post_norms
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert not cfg.norm_topk_prob and cfg.moe_layers == (0, 1)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (64,)  # all 4 heads of q
    assert weights["model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (32, 64)


def test_clip_qkv_is_refused() -> None:
    with pytest.raises(ValueError, match="clip_qkv"):
        arch_from_hf_config({"architectures": ["OlmoeForCausalLM"], "vocab_size": 32, "hidden_size": 16,
                             "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0})


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "OlmoeForCausalLM"
    assert all(isinstance(layer.mlp, SparseMoE) for layer in llm.llm_engine.engine_core.model_runner.model.layers)
    print(tiny.assert_parity(completions, refs))

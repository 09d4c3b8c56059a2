"""Mixtral: Mistral's layers (here with a sliding window) and a mixture of experts (8, top 2, always
renormalized) under Mixtral's checkpoint names (block_sparse_moe, w1/w3/w2); from a Hugging Face folder,
float32 greedy output token-identical to transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.model_loader import load_model_weights, resolve_model


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    # A window of 100: the 170- and 290-token prompts attend through it.
    return tiny.build(MixtralConfig, MixtralForCausalLM, seed=17, num_local_experts=8, num_experts_per_tok=2,
                      intermediate_size=32, sliding_window=100, tie_word_embeddings=False)


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "mixtral" and not cfg.qk_norm and cfg.attention_windows == (100,)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and cfg.moe_layers == (0, 1)  # renormalized whatever the config says
    assert weights["model.layers.0.block_sparse_moe.experts.7.w2.weight"].shape == (64, 32)
    assert weights["model.layers.1.block_sparse_moe.gate.weight"].shape == (8, 64)


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "MixtralForCausalLM"
    moe = llm.llm_engine.engine_core.model_runner.model.layers[1].mlp
    assert moe.renormalize and len(moe.experts) == 8
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]]) -> None:
    """llama.cpp writes Mixtral as a "llama" file with an expert count, Q/K rows in interleaved-rotary
    order and each layer's experts stacked (ffn_{gate,up,down}_exps, router ffn_gate_inp); read back under
    Mixtral's checkpoint names. No window here: llama.cpp's Llama files carry none (Mixtral 8x7B has none)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    model = tiny.build(MixtralConfig, MixtralForCausalLM, seed=19, num_local_experts=4, num_experts_per_tok=2,
                       intermediate_size=32, sliding_window=None, tie_word_embeddings=False)
    path = tiny.write_gguf(model, tokenizer, model_dir / "mixtral-f16.gguf", "llama", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.architecture == "mixtral" and cfg.norm_topk_prob and cfg.moe_layers == (0, 1)
    assert weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"].shape == (32, 64)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "MixtralForCausalLM"
    print(tiny.assert_parity(completions, tiny.references(model, prompt_ids)))


def test_gguf_mixtures_vlite_runs_only_from_folders_are_refused(model_dir: Path) -> None:
    """OLMoE GGUF files (experts, llama.cpp's own layout) are refused by name, not as stray tensors."""
    import gguf
    import numpy as np

    path = model_dir / "olmoe.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_embedding_length(16)
    w.add_head_count(2)
    w.add_block_count(1)
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((32, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="olmoe"):
        load_model_weights(resolve_model(str(path)), torch.float32)

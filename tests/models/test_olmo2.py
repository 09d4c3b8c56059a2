"""OLMo 2: norms after attention and MLP only (none before), q/k RMSNorm over the whole q and k
projections; from a Hugging Face folder and from a GGUF file; float32 greedy output token-identical to
transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.model_loader import load_model_weights, resolve_model


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return tiny.build(Olmo2Config, Olmo2ForCausalLM, seed=7, tie_word_embeddings=False, pad_token_id=tiny.ALT_EOS_ID)


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "olmo2" and cfg.qk_norm and cfg.qk_norm_full and cfg.post_norms
    assert not (cfg.attention_bias or cfg.mlp_bias or cfg.sandwich_norms)
    # q's norm spans its 4 heads of 16, k's its 2
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (64,)
    assert weights["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
    assert "model.layers.1.post_feedforward_layernorm.weight" in weights
    assert "model.layers.1.input_layernorm.weight" not in weights


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "Olmo2ForCausalLM"
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    """llama.cpp's layout: post_attention_norm and post_ffw_norm, no attn_norm / ffn_norm, q/k norms as wide
    as the projections, Q/K rows in Hugging Face order (NEOX rotary), an untied output."""
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "olmo2-f16.gguf", "olmo2", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.architecture == "olmo2" and cfg.qk_norm and cfg.qk_norm_full and cfg.post_norms
    assert not cfg.tie_word_embeddings and weights["model.layers.0.self_attn.q_norm.weight"].shape == (64,)
    state = hf_model.state_dict()
    for name in ("model.layers.1.post_attention_layernorm.weight", "model.layers.1.post_feedforward_layernorm.weight",
                 "model.layers.0.self_attn.k_norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=0)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "Olmo2ForCausalLM"
    print(tiny.assert_parity(completions, refs))
    # transformers' GGUF reader does not know olmo2: the tokenizer still comes from the file's metadata
    text = "def wrap(self, text):\n    return [line for line in text]"
    assert llm.get_tokenizer().encode(text) == tokenizer.encode(text)


def test_int8_close_to_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    """Quantized, the whole-projection q/k norms run on the C++ kernels over column slices of the fused
    QKV output (rows strided by the QKV width)."""
    from vlite import LLM

    llm = LLM(model=str(folder), dtype="float32", quantization="int8", max_num_batched_tokens=8,
              kv_cache_memory_bytes=16 * 2**20)
    attn = llm.llm_engine.engine_core.model_runner.model.layers[0].self_attn
    if attn.ops is None:
        pytest.skip("vlite's C++ kernels are unavailable here")
    assert attn.q_norm.ops is not None and attn.k_norm.ops is not None
    rate, median, worst = tiny.teacher_forced_agreement(llm, prompt_ids, refs)
    print(f"int8 OLMo 2 vs transformers float32: top-1 {rate:.1%}, |logprob gap| median {median:.4f} max {worst:.3f}")
    assert rate >= 0.9 and median < 0.03 and worst < 0.2

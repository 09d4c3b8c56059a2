"""Qwen3 (dense): q/k RMSNorm per head before rotary, explicit head_dim; from a Hugging Face folder
(untied head) and from a GGUF file; float32 greedy output token-identical to transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.model_loader import load_model_weights, resolve_model


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 32 with 4 heads: q is 128 wide on a hidden size of 64, as Qwen3 checkpoints do.
    return tiny.build(Qwen3Config, Qwen3ForCausalLM, seed=3, head_dim=32, tie_word_embeddings=False,
                      rope_theta=1e6, attention_bias=False)


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "qwen3" and cfg.qk_norm and cfg.head_dim == 32
    assert not (cfg.attention_bias or cfg.attention_out_bias or cfg.mlp_bias)
    assert not cfg.tie_word_embeddings and "lm_head.weight" in weights
    assert cfg.eos_token_ids == (tiny.EOS_ID, tiny.ALT_EOS_ID) and cfg.rope_theta == 1e6
    assert weights["model.layers.1.self_attn.k_norm.weight"].shape == (32,)


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "Qwen3ForCausalLM"
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "qwen3-f16.gguf", "qwen3", f16=True)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "Qwen3ForCausalLM"
    print(tiny.assert_parity(completions, refs))
    text = "def wrap(self, text):\n    return [line for line in text]"
    assert llm.get_tokenizer().encode(text) == tokenizer.encode(text)
    assert llm.get_tokenizer().chat_template == tiny.CHAT_TEMPLATE
    # A second load reads the converted-GGUF cache (model_dir's): the same config, features included.
    cached, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert list((model_dir / "cache").glob("qwen3-f16-*")) and cached == llm.llm_engine.engine_core.model_runner.arch
    assert cached.qk_norm and cached.head_dim == 32 and "model.layers.0.self_attn.q_norm.weight" in weights


def test_int8_close_to_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    """Quantized, the q/k norms run on the C++ kernels and the layers one by one (the fused decode
    layer has no q/k norm). Steps of 8 tokens keep every token on the integer kernels. Measured:
    95% top-1 agreement, median logprob gap 0.007; without the q norm: 40%, 0.27."""
    from vlite import LLM

    llm = LLM(model=str(folder), dtype="float32", quantization="int8", max_num_batched_tokens=8,
              kv_cache_memory_bytes=16 * 2**20)
    model = llm.llm_engine.engine_core.model_runner.model
    attn = model.layers[0].self_attn
    if attn.ops is None:
        pytest.skip("vlite's C++ kernels are unavailable here")
    assert attn.q_norm.ops is not None and not hasattr(model, "_fused_layers")
    rate, median, worst = tiny.teacher_forced_agreement(llm, prompt_ids, refs)
    print(f"int8 Qwen3 vs transformers float32: top-1 {rate:.1%}, |logprob gap| median {median:.4f} max {worst:.3f}")
    assert rate >= 0.9 and median < 0.03 and worst < 0.2

"""The default GGUF must load to exactly what transformers' own GGUF loader produces."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vlite.layers.packed import PackedTensors
from vlite.model_loader import LlamaArchConfig, load_model_weights, load_tokenizer, resolve_model
from vlite.model_loader.resolve import ResolvedModel


@pytest.fixture(scope="module")
def resolved() -> ResolvedModel:
    return resolve_model(None)


@pytest.fixture(scope="module")
def ours(resolved: ResolvedModel) -> tuple[LlamaArchConfig, dict[str, torch.Tensor]]:
    return load_model_weights(resolved, torch.float32)


@pytest.fixture(scope="module")
def reference(hf_model: Any) -> Any:
    """transformers' model loaded from the same file (the reference implementation; the session's)."""
    return hf_model


def test_resolve_default(resolved: ResolvedModel) -> None:
    assert resolved.gguf_file is not None and resolved.gguf_file.is_file()
    assert resolved.gguf_file.parent == resolved.path
    assert resolved.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_config_matches_transformers(ours: tuple[LlamaArchConfig, Any], reference: Any) -> None:
    cfg, _ = ours
    ref = reference.config
    assert cfg.architecture == "llama"
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "attention_bias",
        "mlp_bias",
        "rms_norm_eps",
    ):
        assert getattr(cfg, field) == getattr(ref, field), field
    rope = getattr(ref, "rope_parameters", None) or {}
    ref_theta = getattr(ref, "rope_theta", None) or rope["rope_theta"]
    assert cfg.rope_theta == ref_theta
    assert cfg.rope_scaling is None and rope.get("rope_type", "default") == "default"
    ref_eos = ref.eos_token_id if isinstance(ref.eos_token_id, list) else [ref.eos_token_id]
    assert list(cfg.eos_token_ids) == ref_eos
    # Known values of SmolLM2-135M-Instruct.
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings


def test_weights_match_transformers(ours: tuple[LlamaArchConfig, dict[str, torch.Tensor]], reference: Any) -> None:
    cfg, weights = ours
    ref = reference.state_dict()
    assert cfg.tie_word_embeddings and "lm_head.weight" not in weights
    assert set(ref) - {"lm_head.weight"} == set(weights)
    weights = {name: w.dequantize() if isinstance(w, PackedTensors) else w for name, w in weights.items()}
    for name, tensor in weights.items():
        expected = ref[name]
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected), name
    assert torch.equal(ref["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_tokenizer(resolved: ResolvedModel) -> None:
    tok = load_tokenizer(resolved)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = "Hello, world! Ünïcode and   spaces.\nNew line."
    ids = tok.encode(text, add_special_tokens=False)
    assert ids and tok.decode(ids) == text
    assert tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    assert "Hi" in prompt

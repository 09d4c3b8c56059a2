"""Fast checks: safetensors folders, resolve_model errors, Q/K permutation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vlite.model_loader import load_model_weights, resolve_model
from vlite.model_loader.gguf_loader import gguf_to_hf_name, unpermute_qk


def _tiny_llama(tmp_path: Path, tie: bool, rope: dict | None) -> tuple[Path, dict[str, torch.Tensor], object]:
    """Save a random 2-layer Llama with transformers and return its folder and weights."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    kwargs: dict = {}
    if rope is not None:
        kwargs["rope_parameters"] = rope
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        **kwargs,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 7])
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}, config


@pytest.mark.parametrize("tie", [False, True])
def test_hf_folder_roundtrip(tmp_path: Path, tie: bool) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    folder, ref, hf_config = _tiny_llama(tmp_path, tie, rope)
    resolved = resolve_model(str(folder))
    assert resolved.gguf_file is None and resolved.path == folder.resolve()

    cfg, weights = load_model_weights(resolved, torch.float32)
    expected_names = set(ref) - ({"lm_head.weight"} if tie else set())
    assert set(weights) == expected_names
    for name, tensor in weights.items():
        assert torch.equal(tensor, ref[name]), name
    assert cfg.tie_word_embeddings is tie
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (128, 32, 64)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 8)
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 256
    assert cfg.rope_theta == 50000.0
    assert cfg.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 7)
    assert not cfg.attention_bias and not cfg.mlp_bias

    _, w16 = load_model_weights(resolved, torch.float16)
    assert all(t.dtype == torch.float16 for t in w16.values())


def test_unsupported_architecture_folder(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2MoeForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model_weights(resolve_model(str(folder)), torch.float32)


def test_resolve_missing_paths() -> None:
    for value in ("/nonexistent/dir/model.gguf", "./no/such/folder", "missing.gguf", "~/nope/x/y"):
        with pytest.raises(ValueError, match="model path does not exist") as e:
            resolve_model(value)
        assert "model=" in str(e.value) and value in str(e.value)


def test_resolve_hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = "vlite-test-org/definitely-not-cached-model"
    with pytest.raises(ValueError) as e:
        resolve_model(repo)
    msg = str(e.value)
    assert "model=" in msg and repo in msg
    assert "neither a local path nor in the local Hugging Face cache" in msg


def test_resolve_gguf_folders(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    one = resolve_model(str(tmp_path))
    assert one.gguf_file == (tmp_path / "a.gguf").resolve() and one.path == tmp_path.resolve()
    assert resolve_model(str(tmp_path / "a.gguf")) == one
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"a\.gguf, b\.gguf"):
        resolve_model(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="model="):
        resolve_model(str(empty))


def _hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's Q/K row order (interleaved rotary pairs), written from its definition."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_converter(n_head: int) -> None:
    w = np.random.default_rng(0).standard_normal((n_head * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_qk(_hf_to_gguf_permute(w, n_head), n_head), w)
    b = np.arange(n_head * 8, dtype=np.float32)
    assert np.array_equal(unpermute_qk(_hf_to_gguf_permute(b, n_head), n_head), b)


def test_gguf_names() -> None:
    assert gguf_to_hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.0.ffn_gate_exps.weight") is None

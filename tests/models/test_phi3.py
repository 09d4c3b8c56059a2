"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj tensors in the checkpoint, rotary over 3/4 of
each head (Phi-4-mini's partial_rotary_factor), a sliding window on every layer (Phi-3-mini-4k);
and LongRoPE within the original context; from Hugging Face folders and from GGUF files laid out as
llama.cpp's converter writes them; float32 greedy output token-identical to transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.model_loader import ModelArchConfig, load_model_weights, resolve_model

WINDOW = 100  # shorter than the longest prompts: the window changes their outputs


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    # head_dim 16: rotary turns the leading 12 dims of each head, the last 4 pass unrotated.
    return tiny.build(Phi3Config, Phi3ForCausalLM, seed=5, tie_word_embeddings=False, sliding_window=WINDOW,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
                      pad_token_id=tiny.ALT_EOS_ID)


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "phi3" and cfg.fused_checkpoint
    assert cfg.partial_rotary_factor == 0.75 and cfg.rotary_dim == 12 and cfg.rope_scaling is None
    assert cfg.layer_windows == (WINDOW, WINDOW)
    assert weights["model.layers.0.self_attn.qkv_proj.weight"].shape == (16 * (4 + 2 * 2), 64)
    assert weights["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 128, 64)
    assert "model.layers.0.self_attn.q_proj.weight" not in weights


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "Phi3ForCausalLM"
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    """llama.cpp's layout: attn_qkv and ffn_up (gate and up) stay fused, rope.dimension_count 12 of head_dim
    16, the window on every layer, Q/K rows in Hugging Face order (NEOX rotary)."""
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "phi3-f16.gguf", "phi3", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.architecture == "phi3" and cfg.fused_checkpoint and cfg.head_dim == 16 and cfg.rotary_dim == 12
    assert cfg.layer_windows == (WINDOW, WINDOW) and cfg.rope_scaling is None and not cfg.tie_word_embeddings
    state = hf_model.state_dict()
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=0)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "Phi3ForCausalLM"
    print(tiny.assert_parity(completions, refs))


def test_packed_fused_weights_split(hf_model: Any) -> None:
    """A quantized GGUF file's fused tensors stay packed: the split takes row blocks of the blocks, the values
    those of the dense split (Q8_0 here)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from vlite.layers.packed import PackedTensors
    from vlite.model_loader.gguf_quants import to_packed
    from vlite.models.phi3 import split_fused

    cfg = ModelArchConfig.from_hf_config(hf_model.config.to_dict())
    dense = {name: t.detach() for name, t in hf_model.state_dict().items()}
    packed = {}
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
        data = quantize(dense[name].numpy(), GGMLQuantizationType.Q8_0)
        packed[name] = to_packed(data, GGMLQuantizationType.Q8_0, tuple(dense[name].shape))
        dense[name] = packed[name].dequantize()
    want, got = split_fused(cfg, dense), split_fused(cfg, {**dense, **packed})
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        part = got[f"model.layers.0.{proj}.weight"]
        assert isinstance(part, PackedTensors)
        torch.testing.assert_close(part.dequantize(), want[f"model.layers.0.{proj}.weight"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def longrope_model() -> Any:
    """Phi-4-mini's layout: longrope over 3/4 of each head, a context 4x the original one."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 512, "short_factor": [1.0, 1.3, 1.9, 2.6, 4.2, 7.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
    return tiny.build(Phi3Config, Phi3ForCausalLM, seed=6, tie_word_embeddings=True, max_position_embeddings=2048,
                      original_max_position_embeddings=512,
                      rope_parameters=rope, pad_token_id=tiny.ALT_EOS_ID)


@pytest.fixture(scope="module")
def longrope_folder(longrope_model: Any, tokenizer: Any, model_dir: Path) -> Path:
    return tiny.save_hf(longrope_model, tokenizer, model_dir / "longrope")


def test_longrope_matches_transformers(longrope_folder: Path, prompt_ids: list[list[int]]) -> None:
    """Within original_max_position_embeddings transformers rotates with the short factors, and scales
    cos/sin by sqrt(1 + ln(4) / ln(512)); vlite serves exactly that context."""
    from transformers import AutoModelForCausalLM

    cfg, _ = load_model_weights(resolve_model(str(longrope_folder)), torch.float32)
    assert cfg.max_position_embeddings == 512 and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(512)) ** 0.5)
    refs = tiny.references(AutoModelForCausalLM.from_pretrained(longrope_folder).eval(), prompt_ids)
    llm, completions = tiny.run_vlite(longrope_folder, prompt_ids)
    print(tiny.assert_parity(completions, refs))


def test_longrope_gguf_matches_transformers(longrope_model: Any, tokenizer: Any, model_dir: Path,
                                            prompt_ids: list[list[int]]) -> None:
    """A LongRoPE GGUF file: the factors as rope_factors_long / rope_factors_short tensors, the original
    context and the attention factor in the metadata; no output tensor (tied)."""
    path = tiny.write_gguf(longrope_model, tokenizer, model_dir / "longrope-f16.gguf", "phi3", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    rope = longrope_model.config.rope_parameters
    assert cfg.rope_scaling["short_factor"] == pytest.approx(rope["short_factor"])
    assert cfg.rope_scaling["long_factor"] == pytest.approx(rope["long_factor"])
    assert cfg.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(512)) ** 0.5)
    assert cfg.max_position_embeddings == 512 and cfg.rotary_dim == 12 and cfg.tie_word_embeddings
    assert not any("rope_factors" in name for name in weights)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    print(tiny.assert_parity(completions, tiny.references(longrope_model, prompt_ids)))


def test_unsupported_rope_scaling_refused(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    with pytest.raises(ValueError, match="yarn"):
        ModelArchConfig.from_hf_config(config)

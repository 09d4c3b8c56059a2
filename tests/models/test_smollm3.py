"""SmolLM3: Llama's layers, some of them without rotary (no_rope_layers); float32 greedy output
token-identical to transformers, from a Hugging Face folder and from a GGUF file (llama.cpp's layout: every
fourth layer NoPE). Sliding-window SmolLM3 configs are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.model_loader import load_model_weights, resolve_model
from vlite.model_loader.hf_config import arch_from_hf_config


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    # three layers, the middle one NoPE (1 = rotary, 0 = none)
    return tiny.build(SmolLM3Config, SmolLM3ForCausalLM, seed=9, num_hidden_layers=3, no_rope_layers=[1, 0, 1],
                      tie_word_embeddings=True, pad_token_id=tiny.ALT_EOS_ID, bos_token_id=None)


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "smollm3" and cfg.nope_layers == (1,) and cfg.tie_word_embeddings
    assert not cfg.layer_windows and "lm_head.weight" not in weights


def test_nope_layers_from_interval() -> None:
    """Without no_rope_layers, every no_rope_layer_interval-th layer is NoPE (transformers' default: 4)."""
    config = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 8, "num_attention_heads": 2, "no_rope_layer_interval": 4}
    assert arch_from_hf_config(config).nope_layers == (3, 7)


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "SmolLM3ForCausalLM"
    model = llm.llm_engine.engine_core.model_runner.model
    assert [layer.self_attn.use_rope for layer in model.layers] == [True, False, True]
    print(tiny.assert_parity(completions, refs))


@pytest.fixture(scope="module")
def gguf_model() -> Any:
    """Four layers, the last one NoPE: llama.cpp's fixed pattern (every fourth layer), which a GGUF file does not
    spell out; an untied head."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    return tiny.build(SmolLM3Config, SmolLM3ForCausalLM, seed=10, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
                      tie_word_embeddings=False, pad_token_id=tiny.ALT_EOS_ID, bos_token_id=None, rope_theta=1e4)


def test_gguf_matches_transformers(gguf_model: Any, tokenizer: Any, model_dir: Path,
                                   prompt_ids: list[list[int]]) -> None:
    """llama.cpp's layout: Llama's tensors with Q/K rows in its interleaved-rotary order, no NoPE metadata."""
    path = tiny.write_gguf(gguf_model, tokenizer, model_dir / "smollm3-f16.gguf", "smollm3", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.architecture == "smollm3" and cfg.nope_layers == (3,) and not cfg.tie_word_embeddings
    state = gguf_model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=0)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "SmolLM3ForCausalLM"
    model = llm.llm_engine.engine_core.model_runner.model
    assert [layer.self_attn.use_rope for layer in model.layers] == [True, True, True, False]
    print(tiny.assert_parity(completions, tiny.references(gguf_model, prompt_ids)))
    text = "def wrap(self, text):\n    return [line for line in text]"
    assert llm.get_tokenizer().encode(text) == tokenizer.encode(text)


def test_sliding_window_refused(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=64,
                  layer_types=["full_attention", "sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="sliding-window"):
        arch_from_hf_config(config)

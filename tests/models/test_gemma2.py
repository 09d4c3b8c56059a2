"""Gemma 2: attention-logit and final-logit soft-capping, every other layer a sliding window (the
first one included), queries scaled by query_pre_attn_scalar ** -0.5 (not head_dim's), (1 + weight)
norms before and after attention and MLP, GELU-tanh, embeddings scaled by sqrt(hidden), tied head;
from a Hugging Face folder and from a GGUF file laid out as llama.cpp's converter writes one; float32 greedy
output token-identical to transformers on prompts longer than the window, chunked prefill mixed with decodes.

The caps are small (scores and logits of these random weights would never reach Gemma's 50 and 30),
so that a missing or misplaced tanh changes the output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.model_loader import ModelArchConfig, load_model_weights, resolve_model


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


@pytest.fixture(scope="module")
def gguf_model() -> Any:
    """The same model with query_pre_attn_scalar = head_dim: what llama.cpp assumes for every Gemma 2 file but
    the 27B's (a GGUF file stores no query_pre_attn_scalar)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return tiny.build(Gemma2Config, Gemma2ForCausalLM, seed=11, num_hidden_layers=2, head_dim=16,
                      query_pre_attn_scalar=16, sliding_window=20, attn_logit_softcapping=1.5,
                      final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh", rope_theta=1e4)


def test_gguf_matches_transformers(gguf_model: Any, tokenizer: Any, model_dir: Path,
                                   prompt_ids: list[list[int]]) -> None:
    """llama.cpp's layout: soft-caps and the window in the metadata (every other layer sliding, the first one
    included, is llama.cpp's fixed pattern), post_attention_norm / ffn_norm / post_ffw_norm, norms stored
    with the 1 of (1 + weight) added, no lm_head."""
    path = tiny.write_gguf(gguf_model, tokenizer, model_dir / "gemma2-f16.gguf", "gemma2", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.architecture == "gemma2" and cfg.layer_windows == (20, 0) and cfg.query_pre_attn_scalar == 16
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.5, 4.0) and cfg.tie_word_embeddings
    assert cfg.norm_unit_offset and cfg.sandwich_norms and not cfg.qk_norm
    state = gguf_model.state_dict()
    for name in ("model.layers.0.pre_feedforward_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                 "model.layers.1.post_feedforward_layernorm.weight", "model.norm.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=1e-7)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "Gemma2ForCausalLM"
    print(tiny.assert_parity(completions, tiny.references(gguf_model, prompt_ids)))


def test_gguf_query_scale_and_defaults(tmp_path: Path) -> None:
    """llama.cpp scales queries by head_dim ** -0.5, but Gemma 2 27B's (46 layers) by (hidden / heads) ** -0.5;
    a file without window or soft-cap keys (converted before the converter wrote them) gets Gemma 2's."""
    import gguf

    from vlite.model_loader.gguf_config import arch_from_gguf_metadata
    from vlite.model_loader.gguf_reader import GGUFReader

    def config(n_layers: int, window: int | None = 1024) -> ModelArchConfig:
        w = gguf.GGUFWriter(str(tmp_path / f"{n_layers}-{window}.gguf"), "gemma2")
        for add, value in ((w.add_vocab_size, 32), (w.add_embedding_length, 4608), (w.add_feed_forward_length, 64),
                           (w.add_block_count, n_layers), (w.add_head_count, 32), (w.add_head_count_kv, 16),
                           (w.add_key_length, 128)):
            add(value)
        if window is not None:
            w.add_sliding_window(window)
            w.add_attn_logit_softcapping(20.0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return arch_from_gguf_metadata(GGUFReader(str(tmp_path / f"{n_layers}-{window}.gguf")))

    assert config(46).query_pre_attn_scalar == 4608 / 32 and config(42).query_pre_attn_scalar == 128
    given, unsaid = config(42), config(42, None)
    assert given.layer_windows[:4] == (1024, 0, 1024, 0) and given.attn_logit_softcapping == 20.0
    assert given.final_logit_softcapping == 30.0
    assert unsaid.layer_windows[:3] == (4096, 0, 4096) and unsaid.attn_logit_softcapping == 50.0
